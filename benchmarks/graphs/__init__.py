"""Offloading inside CUDA graphs."""
