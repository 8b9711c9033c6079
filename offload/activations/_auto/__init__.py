"""The ``offload_layers="auto"`` policy: prediction, families of shapes, fit, probe."""
