"""Recompute: offloaded checkpointing and its calls, reentrant recompute, the head and loss in slices, tiled blocks."""
