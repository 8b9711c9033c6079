"""Long context on one GPU: the head and tiling levers against the tools users pick."""
