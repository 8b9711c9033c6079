"""Helpers for ``main_grad`` buffers (DESIGN.md 4.9)."""
