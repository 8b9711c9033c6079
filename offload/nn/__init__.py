"""Layers whose weight gradients accumulate straight into ``main_grad`` (docs/design.md 4.9).

- ``Linear``: ``torch.nn.Linear`` with ``fuse_wgrad_accumulation``.
- ``GroupedLinear``: the experts of an MoE layer (TransformerEngine's parameter layout).

Attach the buffers with ``offload.main_grad.attach(model)``; under FSDP2 use
``offload.integrations.fsdp.use_fused_wgrad(model)`` instead.
"""

from offload.nn._grouped import GroupedLinear
from offload.nn._linear import Linear

__all__ = ["Linear", "GroupedLinear"]
