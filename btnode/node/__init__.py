"""The composition root of the daemon: builds domain objects from settings and runs each role."""
