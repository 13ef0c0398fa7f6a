"""Benchmarks: decode speed against context length, and others built on the rooms."""
