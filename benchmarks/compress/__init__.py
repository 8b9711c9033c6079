"""Compressed offload: the fp8 codec's speed, its accuracy, its share of a step."""
