"""Activation offloading: ref-8L and tiny48 steps, "auto", the hooks' host cost, other offloaders."""
