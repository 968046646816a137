"""Benchmarks, one module each, grouped by what they measure (``python -m scripts`` lists them)."""
