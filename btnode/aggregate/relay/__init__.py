"""Relays: a relay's upstream admission and forwarding sink, and the root's side of what relays pass up."""
