"""Trust: claims, replay audits, identities, relay evidence, commits and manifests: what the aggregator checks."""
