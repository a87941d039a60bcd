"""The byte-level DiffusionBlocks model: torch and the standard library only."""
