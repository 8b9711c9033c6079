"""Offloaded checkpointing against torch's checkpoint."""
