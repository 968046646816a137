"""Maintainers' tools: generated docs and the version table."""
