"""Benchmark scripts by topic; each script's docstring gives its command (see README.md)."""
