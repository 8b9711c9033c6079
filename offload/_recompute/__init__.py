"""Recompute: offloaded checkpointing, its calls, and reentrant recompute."""
