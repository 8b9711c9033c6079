"""When no choice of ``offload_layers="auto"`` fits the device: what remains is outside
the layers (Note [memory short]), and :class:`ActivationMemoryError` says so before the
step that would run out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from offload._core import _levers

__all__ = ["LEVERS_OUTSIDE", "ActivationMemoryError", "check_short"]

#: The levers that cut what no layer lever touches, as the error names them.
LEVERS_OUTSIDE = (
    "offload.sliced_head_loss(model)",
    "offload.tile_mlp(model)",
    "offload.WeightOffloader(layers)",
)

# Note [memory short]
# "auto" offloads what memory needs and, past what the link hides, recomputes the later
# layer calls with their inputs offloaded (Note [recomputed calls]). When even that is
# predicted past the device's memory, what remains is outside the layers: the head and
# the loss (tokens x vocab logits in fp32, their softmax and gradient), the weights,
# their gradients and optimizer states. No choice of "auto" reaches it, and the default
# does not change the user's model on its own (it never installs the head lever).
#
# It raises ActivationMemoryError, before the step's first layer runs, only when the
# shortfall is measured, not predicted:
#   - the activation bytes with every call but the last offloaded were measured at
#     this very size (a measuring forward at these tokens: Estimate.exact), and
#   - what is allocated now plus those bytes exceeds the device's own limit (no margin,
#     nothing of what the allocator reserved beyond them counted): the step cannot fit.
# The measuring step at that size ran, so this happens when more is allocated now than
# then (optimizer states made after the first step, another model loaded). Otherwise
# (bytes predicted at a size not measured, or past the limit less memory_margin only) the
# prediction may be wrong in the direction of a step that fits, and it warns once
# instead. It also only warns where the head lever is installed on the model that holds
# the layers (offload._core._levers): the user opted in to the levers outside the layers
# and the rest is theirs to size.


class ActivationMemoryError(torch.OutOfMemoryError):
    """The step cannot fit the device even with every layer call offloaded or
    recomputed (``offload_layers="auto"``, Note [memory short] in
    ``offload/activations/_auto/_short.py``): raised before the step's first layer
    runs, so nothing of it was allocated. A subclass of ``torch.OutOfMemoryError``.

    Attributes:
        needed_bytes: allocated when the step started plus the activation bytes measured
            at this size with every layer call but the last offloaded.
        free_bytes: the device memory this process may still use (its limit less what
            is allocated).
        limit_bytes: the device memory this process may use in all.
        levers: the levers that cut what remains, outside the layers.
    """

    def __init__(
        self, needed_bytes: int, free_bytes: int, limit_bytes: int, levers: Sequence[str]
    ) -> None:
        self.needed_bytes = int(needed_bytes)
        self.free_bytes = int(free_bytes)
        self.limit_bytes = int(limit_bytes)
        self.levers = tuple(levers)
        gib = 2**30
        super().__init__(
            f"offload_layers='auto': this step needs {self.needed_bytes / gib:.2f} GiB of "
            f"device memory ({self.needed_bytes} bytes: what is allocated now plus the "
            f"activations measured at this size with every layer call offloaded or "
            f"recomputed) and {self.free_bytes / gib:.2f} GiB ({self.free_bytes} bytes) "
            f"are free of {self.limit_bytes / gib:.2f} GiB: what remains is outside the "
            f"layers (the LM head and the loss, the weights, their gradients and "
            f"optimizer states). Levers that cut it: {', '.join(self.levers)} (the "
            f"first computes the head and the loss in slices; offload.plan(...) with a "
            f"budget chooses among them). Raised before the step ran."
        )


def check_short(
    off: Any,
    layers: Sequence[torch.nn.Module],
    exact: bool,
    needed: float,
    device_limit: float,
    allocated: float,
    message: str,
) -> None:
    """Note [memory short]: raise :class:`ActivationMemoryError` when ``needed`` (bytes
    allocated now plus the activations with every call offloaded, ``exact``: measured at
    this size) exceeds ``device_limit`` and no head lever is installed over ``layers``;
    else warn ``message`` once (``off._warn_once``)."""
    if exact and needed > device_limit and not _levers.head_lever_over(layers):
        raise ActivationMemoryError(
            int(needed), int(max(0.0, device_limit - allocated)), int(device_limit), LEVERS_OUTSIDE
        )
    off._warn_once("recompute_short", message)
