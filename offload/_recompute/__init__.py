"""Recompute levers for long sequences: the LM head and loss in slices, sequence-tiled blocks."""
