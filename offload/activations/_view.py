"""A read-only view of what an offloader's most recent forward (and its backward) did, per
layer call: planned, offloaded, released, reloaded, dropped, the buckets of small tensors,
the waits and the auto decision (:attr:`offload.ActivationOffloader.last_step`). A
snapshot: frozen, taken when read, holding no reference into the runtime."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["AutoView", "BucketView", "FamilyView", "LayerView", "StepView", "view_of"]


@dataclasses.dataclass(frozen=True)
class BucketView:
    """One bucket of a layer call: its small tensors of one dtype, gathered into one host
    block and sent in one copy each way (Note [release order], 1(b), in
    ``offload/activations/_step.py``).

    Attributes:
        dtype: the dtype of its tensors.
        nbytes: the bytes of its tensors (those gathered so far while it is open).
        tensors: how many tensors (storages) it holds; a storage saved again is one.
        poisoned: its tensors, by position, found changed in place at the release (their
            unpack raises autograd's in-place error).
        on_host: it holds its host block (an aborted forward returned it).
    """

    dtype: torch.dtype
    nbytes: int
    tensors: int
    poisoned: tuple[int, ...]
    on_host: bool


@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer call (a group) of the step.

    Attributes:
        index: the call's position in the forward (0-based).
        planned: selected for offloading (by the schedule, ``"auto"`` or the caller).
        offloaded: its saves sent bytes to the host.
        released: its device references were dropped after the wait on its copies.
        reloaded: its copies are on the device now (between its reload and its drop).
        dropped: its backward ended and its reload buffers were given up.
        bytes_offloaded: bytes it sent to the host (each storage once).
        bytes_released: device bytes its release freed.
        stall_seconds: how long the compute stream waited for its copies (``None``
            unless timings are recorded: ``timing=True``).
        held_back: how many of its saves are held back now, to be placed after its
            kernels are queued (the step's first call: Note [release order], 1(c));
            ``None`` when none are (another call, or placed already).
        buckets: its buckets (:class:`BucketView`), in the order they were opened.
    """

    index: int
    planned: bool
    offloaded: bool
    released: bool
    reloaded: bool
    dropped: bool
    bytes_offloaded: int
    bytes_released: int
    stall_seconds: float | None
    held_back: int | None
    buckets: tuple[BucketView, ...]


@dataclasses.dataclass(frozen=True)
class FamilyView:
    """One kind of input that ``offload_layers="auto"`` keeps (its measured sizes and
    what its steps taught it).

    Attributes:
        measured_tokens: the token counts of its measured sizes (the points its costs
            at other sizes are fitted to), in the order kept.
        memory_excess: device bytes a step needed beyond its predicted peak, the most
            seen (0.0: none).
    """

    measured_tokens: tuple[int, ...]
    memory_excess: float


@dataclasses.dataclass(frozen=True)
class AutoView:
    """What the ``offload_layers="auto"`` policy remembers when the view is taken.

    Attributes:
        families: one :class:`FamilyView` per kind of input kept, the least recently
            used first.
        state_size: how much it keeps, each bounded: ``families``, ``points`` (measured
            sizes), ``decisions`` (sizes decided), ``pending`` (steps whose times are
            not read yet) and ``samples`` (timed steps kept for verification).
    """

    families: tuple[FamilyView, ...]
    state_size: dict[str, int]


@dataclasses.dataclass(frozen=True)
class StepView:
    """The most recent step of an offloader.

    Attributes:
        layers: one :class:`LayerView` per layer call, in call order.
        forward_done: the forward left the offloader's context.
        backward_done: every group with copies finished its backward.
        capture: ``None`` (eager), ``"step"`` (one CUDA graph for the step) or
            ``"layer"`` (per-layer graphs, :func:`offload.make_graphed_callables`).
        manual: driven by the caller (``get_cpu_offload_context``'s manual mode).
        placed_late_at: the call at whose start the first call's saves were placed
            (``None``: at its own close, or nothing was deferred).
        double_buffer_reuses: reload buffers reused (``double_buffering=True``).
        spare_buffers: reload buffers kept for reuse now (0 once the backward ended).
        waits: the compute stream's waits for copies, in seconds, summed over the
            layers (``None`` unless timings are recorded).
        auto: with ``offload_layers="auto"``, the decision of this step (as
            :attr:`offload.OffloadStats.auto`); else ``None``.
        in_progress: its forward is running now: the offloader is entered and this is
            its current forward.
        aborted: its forward raised: everything it offloaded was freed at once.
        open_layer: the index of the layer call open now (``None``: none).
        awaiting_backward: layer calls with copies whose backward has not ended yet.
        storages_placed: device storages whose saves went to a host copy or a bucket
            so far (each storage once).
        calls: the modules of its layer calls, in call order (those run untracked
            included: Note [untracked calls] in ``offload/activations/_layer_calls.py``).
        graph_host_bytes: host bytes bound now to CUDA graphs captured with the
            offloader (replays write them;
            :meth:`~offload.ActivationOffloader.free_graph_memory` releases them); 0
            without captures.
        auto_state: with ``offload_layers="auto"``, what the policy remembers when the
            view is taken (an :class:`AutoView`); else ``None``.

    Example:
        >>> import offload, torch
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
        >>> off = offload.ActivationOffloader(layers, offload_layers=2, min_tensor_bytes=0)
        >>> x = torch.randn(64, 256, requires_grad=True)
        >>> with off:
        ...     y = layers[2](layers[1](layers[0](x)))
        >>> [(la.planned, la.released) for la in off.last_step.layers]
        [(True, True), (True, True), (False, False)]
        >>> y.sum().backward()
        >>> off.last_step.backward_done, [la.dropped for la in off.last_step.layers]
        (True, [True, True, False])
        >>> off.close()
    """

    layers: tuple[LayerView, ...]
    forward_done: bool
    backward_done: bool
    capture: str | None
    manual: bool
    placed_late_at: int | None
    double_buffer_reuses: int
    spare_buffers: int
    waits: float | None
    auto: dict[str, Any] | None
    in_progress: bool
    aborted: bool
    open_layer: int | None
    awaiting_backward: int
    storages_placed: int
    calls: tuple[torch.nn.Module, ...]
    graph_host_bytes: int
    auto_state: AutoView | None


def _bucket_view(bucket: Any) -> BucketView:
    """The view of one bucket (``offload/activations/_saves.py``, ``_Bucket``)."""
    return BucketView(
        dtype=bucket.dtype,
        nbytes=bucket.fill * bucket.dtype.itemsize,
        tensors=len(bucket.offsets),
        poisoned=tuple(bucket.poisons or ()),
        on_host=bucket.host is not None,
    )


def _auto_view(policy: Any) -> AutoView:
    """The view of an ``offload_layers="auto"`` policy
    (``offload/activations/_auto/_policy.py``)."""
    families = tuple(
        FamilyView(
            measured_tokens=tuple(p.tokens for p in f.model.points) if f.model is not None else (),
            memory_excess=f.memory_excess,
        )
        for f in policy.families.values()
    )
    return AutoView(families=families, state_size=dict(policy.state_size()))


def view_of(source: Any, in_progress: bool = False, policy: Any = None) -> StepView:
    """The view of a step (``offload/activations/_step.py``), or of the captured layer
    calls of :func:`offload.make_graphed_callables` (one step per call, merged).

    Args:
        source: the step, or the captured calls (``steps``: theirs).
        in_progress: ``source`` is the offloader's current forward.
        policy: the offloader's ``"auto"`` policy, or ``None``.
    """
    steps = getattr(source, "steps", None) or [source]
    stats = source.read_stats()
    layers: list[LayerView] = []
    open_layer: int | None = None
    for step in steps:
        with step.rt.lock:
            buckets: dict[int, list[BucketView]] = {}
            for b in step.all_buckets:
                buckets.setdefault(b.owner, []).append(_bucket_view(b))
            if step.open is not None:
                open_layer = len(layers) + step.open.index
            for g in step.groups:
                s = g.stats
                layers.append(
                    LayerView(
                        index=len(layers),
                        planned=g.offload,
                        offloaded=s.bytes_offloaded > 0,
                        released=g.released,
                        reloaded=g.reloaded,
                        dropped=g.dropped,
                        bytes_offloaded=s.bytes_offloaded,
                        bytes_released=s.bytes_released,
                        stall_seconds=s.stall_seconds,
                        held_back=None if g.deferred is None else len(g.deferred),
                        buckets=tuple(buckets.get(g.index, ())),
                    )
                )
    stalls = [la.stall_seconds for la in layers if la.stall_seconds is not None]
    last = steps[-1]
    rt = last.rt
    with rt.lock:
        graph_host_bytes = sum(b.nbytes for b in rt.graph_blocks)
    return StepView(
        layers=tuple(layers),
        forward_done=all(s.forward_done for s in steps),
        backward_done=all(s.backward_done for s in steps),
        capture=last.capture,
        manual=last.manual,
        placed_late_at=last.placed_late_at,
        double_buffer_reuses=sum(s.stats_double_buffer_reuses for s in steps),
        spare_buffers=sum(len(v) for s in steps for v in s.spares.values()),
        waits=sum(stalls) if stalls else None,
        auto=None if stats.auto is None else dict(stats.auto),
        in_progress=in_progress,
        aborted=any(s.aborted for s in steps),
        open_layer=open_layer,
        awaiting_backward=sum(s.awaiting for s in steps),
        storages_placed=sum(len(s.storages) for s in steps),
        calls=tuple(m for s in steps for m in s.calls()),
        graph_host_bytes=graph_host_bytes,
        auto_state=None if policy is None else _auto_view(policy),
    )
