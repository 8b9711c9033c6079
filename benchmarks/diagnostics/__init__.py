"""Diagnostics that feed no published table (see README.md)."""
