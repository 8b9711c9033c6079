"""Recompute levers: offloaded checkpoints, reentrant recompute, sliced head loss, tiled blocks."""
