"""Who drives a step's groups and where their copies are recorded, chosen once a step.

A :class:`Trigger` says who starts, releases and reloads a group (the schedule, or the
caller in manual mode); a :class:`Recording` says whether the copies run eagerly or are
captured into CUDA graphs (Note [release order], "Manual mode" and "CUDA graphs").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload._core import _device

if TYPE_CHECKING:
    from offload.activations._step import Step

__all__ = ["MANUAL", "RECORDINGS", "SCHEDULED", "Recording", "Trigger"]


class Trigger:
    """Who triggers a group's transitions.

    Args:
        manual: the caller does (``get_cpu_offload_context(manual_synchronization=
            True)``): saves are held until ``start_offload_layer``, nothing is released
            on a schedule or at the end of the forward, and a started group whose
            handles all die unreleased is released then.
    """

    __slots__ = ("manual", "holds_saves", "releases_at_end", "releases_on_death", "gathers")

    def __init__(self, manual: bool) -> None:
        self.manual = manual
        self.holds_saves = manual
        self.releases_at_end = not manual
        self.releases_on_death = manual
        #: small tensors travel in buckets (1(b)) and the first call's saves are placed
        #: at its close (1(c)) only when the schedule drives the groups
        self.gathers = not manual


SCHEDULED = Trigger(False)
MANUAL = Trigger(True)


class Recording:
    """Where a step's copies, events and waits are recorded.

    Args:
        capture: ``None`` (eagerly), ``"step"`` (the whole forward and backward in one
            CUDA graph) or ``"layer"`` (each layer call its own graph).
    """

    __slots__ = (
        "capture",
        "fenced",
        "binds_blocks",
        "releases_at_close",
        "reload_waits_d2h",
        "gathers",
    )

    def __init__(self, capture: str | None) -> None:
        self.capture = capture
        #: copies wait for and set the pool's H2D fence (a capture cannot wait on an
        #: event recorded outside it, and no other copy reuses a graph-bound block)
        self.fenced = capture is None
        #: a dead copy's host block stays bound to the graph (replays write it)
        self.binds_blocks = capture is not None
        #: per layer: each graph joins its own D2H at its close
        self.releases_at_close = capture == "layer"
        #: per layer: a reload cannot wait for an event of another graph
        self.reload_waits_d2h = capture != "layer"
        self.gathers = capture is None

    def check_open(self, step: Step) -> None:
        """Raise when a group cannot open under this recording (lock held)."""
        if self.capture is None:
            if _device.capturing():
                raise RuntimeError(
                    "offload: a CUDA graph capture began after the offloader was entered, "
                    "so the offloader cannot tell which of its copies belong to the graph. "
                    "Enter the offloader inside the capture (with torch.cuda.graph(g): with "
                    "offloader: ...), or graph single layers with "
                    "offload.make_graphed_callables."
                )
            return
        cfg = step.cfg
        if cfg.timing:
            raise RuntimeError(
                "offload: timing=True reads CUDA event times, which a CUDA graph capture "
                "does not allow; pass timing=False to the offloader used in the capture"
            )
        if step.probe:
            raise RuntimeError(
                "offload: offload_layers='auto' measures the first forward of each kind "
                "of input, and a CUDA graph capture cannot be measured; run two eager steps "
                "with the capture's shapes first (the usual warm-up), or pass an explicit "
                "offload_layers"
            )
        if step.compress:
            raise NotImplementedError(
                "offload: compress='fp8' is not supported inside CUDA graph captures yet; "
                "pass compress=None to the offloader used in the capture"
            )


RECORDINGS = {kind: Recording(kind) for kind in (None, "step", "layer")}
