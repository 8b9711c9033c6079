"""The runtime's foundation: streams and events, the pinned host pool, host copies, the one
runtime, packing of saved tensors, the fp8 codec, dynamo boundaries, measuring, helpers.
It imports nothing of the package but itself and :mod:`offload.stats`."""
