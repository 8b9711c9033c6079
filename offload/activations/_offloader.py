"""Activation offloading's public front: :class:`ActivationOffloader` (the context that
offloads what its layers save for backward) and :func:`no_offload`."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

import offload.activations._attach as _attach
from offload._core import _context, _device, _dynamo
from offload._core._runtime import Runtime
from offload._core._runtime import enter_no_offload as _enter_no_offload
from offload._core._runtime import exit_no_offload as _exit_no_offload
from offload._core._warn import warn_at_caller
from offload.activations._attach import AttachHandle, LayerHooks
from offload.activations._auto._policy import AutoPolicy
from offload.activations._diagnose import CallOrder
from offload.activations._handles import unpack_hook
from offload.activations._layer_calls import LayerCalls
from offload.activations._manual import _prune
from offload.activations._recompute_calls import RecomputedCalls
from offload.activations._schedule import check_selection, plan_forward
from offload.activations._step import Step
from offload.activations._view import StepView, view_of
from offload.config import LayerSelection, OffloadConfig
from offload.stats import OffloadStats

__all__ = ["ActivationOffloader", "no_offload"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}

_NO_FORWARD_YET = (
    "offload: no forward has run under this offloader yet, so there is nothing to "
    "report. Run a forward inside `with offloader:` (and its backward), then call report()."
)

_NOT_CALLED = (
    "offload: none of the {n} layers given to ActivationOffloader ran inside `with "
    "offloader:`, so nothing was offloaded. Pass the modules the forward calls (for a "
    "Hugging Face model, offload.find_layers(model)), and run the forward inside the "
    "`with` block."
)

#: added to _NOT_CALLED once dynamo has compiled something
_NOT_CALLED_COMPILED = (
    " Layers wrapped by torch.compile(layer) and run before the offloader first hooked "
    "them call their compiled code without its hooks: give the offloader the wrappers "
    "(docs/compile.md)."
)


@dataclasses.dataclass(frozen=True)
class CaptureView:
    """What per-layer CUDA graph capture (``offload/activations/_graphs.py``) reads from an
    :class:`ActivationOffloader`: its layers, its runtime and its layer selection."""

    layers: tuple[torch.nn.Module, ...]
    runtime: Runtime
    selection: LayerSelection


class ActivationOffloader(LayerCalls):
    """Offload the activations that layers save for backward to host memory.

    Inside ``with offloader:`` every tensor that autograd saves while one of ``layers``
    runs is copied to host memory as soon as it is saved, on a side stream, and the
    device copy is dropped once the copy has landed, as late as keeps at most
    ``L - k`` offloaded layers' activations resident (L layer calls, k offloaded). The
    backward (run outside the context) brings each group back a few layers before it is
    needed. Gradients are bitwise identical to a run without offloading.

    Args:
        layers: the repeated blocks, in call order (e.g. ``model.layers`` or
            :func:`offload.find_layers`). Each call of one of them is a group.
        offload_layers: which groups are offloaded. ``"auto"`` (default): the first
            forward of each kind of input offloads like ``"all"`` (never more device
            memory) and measures every layer (device and host time, bytes); later
            forwards offload the longest prefix of layers whose predicted step stays
            within ``max_slowdown``, and never fewer than the free device memory
            needs; sizes not measured (a new sequence length) are predicted from those
            measured. The choice is verified against steps without offloading, in
            alternation, while memory allows them, and one layer comes off at a time
            while the measured ratio exceeds ``1 + max_slowdown``. ``stats.auto`` says
            what was chosen and why (predicted and measured ratios, the memory reason).
            Without an accelerator ``"auto"`` selects like ``"all"``. ``"all"`` or ``None``: all
            but the last; ``int`` n: the first n; a sequence of indices; or
            ``callable(index, module) -> bool`` (its signature is checked here).
        min_tensor_bytes: tensors whose copied bytes are fewer stay on the device.
            Default ``256 * 1024``.
        prefetch_layers: ``None`` (default) reloads as early as the resident bound
            allows; ``int`` n reloads a group when the backward of the layer n calls
            later starts.
        pin_memory: page-lock host buffers. Default ``True``; ignored without an
            accelerator.
        host_memory_limit: bytes of host memory for offloaded tensors. ``None``
            (default): half of the available memory divided by ``LOCAL_WORLD_SIZE``.
            Past it, tensors stay on the device (reason ``host_limit``, one warning).
        double_buffering: during one backward, reuse the reload buffers of a finished
            group for a later group with the same span sizes, when nothing references
            them any more (else fresh buffers: never corrupt, only lose the reuse).
            Spares are freed when the backward of the forward ends. Default ``False``:
            PyTorch's caching allocator already recycles those blocks
            (docs/performance.md, "Double buffering", has the measurement).
        tensor_filter: ``callable(tensor) -> bool``; ``False`` keeps a tensor on the
            device (reason ``filtered``). Default ``None``.
        timing: record CUDA-event times of every copy and of every wait of the compute
            stream for a copy; reading :attr:`stats` then fills each layer's
            ``d2h_seconds``, ``h2d_seconds`` and ``stall_seconds`` (and waits on the
            host for the recorded copies). Default ``False`` (the fields stay ``None``).
        max_slowdown: the step-time increase ``"auto"`` may spend, as a fraction of the
            step without offloading. Default ``0.03``.
        compress: ``None`` (default, lossless: gradients bitwise equal to no
            offloading) or ``"fp8"`` (opt-in, lossy): floating tensors travel as
            ``float8_e4m3fn`` with one fp32 scale per 128 consecutive elements, about
            half the link bytes and host memory of bf16. Each element ``x`` comes back
            within about ``2**-4 * |x| + 2**-10 * amax / 448`` (``amax``: the largest
            finite magnitude in its block of 128), plus the rounding of the cast back
            to its dtype (exact statement: ``offload/_core/_compress.py``); an inf or NaN
            comes back as NaN, alone. ``stats`` reports the bytes before and after
            compression.
        compress_filter: ``callable(tensor) -> bool``; ``True`` compresses a floating
            tensor, ``False`` sends it exactly. Default ``None``: bf16 and fp16 tensors
            are compressed and fp32 ones travel exactly (mixed precision's softmax and
            norm statistics; ``lambda t: True`` compresses fp32 too).
        config: an :class:`OffloadConfig` instead of the keywords above.

    Raises:
        TypeError: ``layers`` is not a sequence of ``nn.Module``; a keyword has the
            wrong type; a callable ``offload_layers`` does not take ``(index,
            module)``; both ``config`` and keywords are given.
        ValueError: ``layers`` is empty or lists a module twice; ``offload_layers``
            is out of range for ``len(layers)`` or an unknown string; a numeric keyword
            is out of range.
        RuntimeError: (on entering) this or another offload context is already
            active on the thread.

    Threads and ``torch.compile``: the layer hooks act only for the thread that
    entered this offloader (another thread, with its own offloader over the same
    modules, is left alone); they run eagerly under ``torch.compile`` (a layer
    compiled with ``layer.compile()`` gets a graph break before and after its body:
    docs/compile.md).

    CUDA graphs: a step captured whole (``torch.cuda.graph``) offloads when the
    offloader is entered inside the capture; replays then run its copies with no Python.
    For per-layer graphs use :func:`offload.make_graphed_callables`.

    Invariants (``# Note [release order]`` in ``offload/activations/_step.py`` says why each
    holds): a copy never starts before the kernel that produced its bytes; a device block
    is never freed before its copy finished; a reloaded tensor is never read before its
    copy finished; host memory comes from a pool of slabs reused across steps; nothing
    waits on the host in steady state.

    Example:
        >>> layers = [torch.nn.Linear(512, 512) for _ in range(4)]
        >>> model = torch.nn.Sequential(*layers)
        >>> offloader = ActivationOffloader(layers, min_tensor_bytes=0)
        >>> x = torch.randn(64, 512, requires_grad=True)
        >>> with offloader:
        ...     loss = model(x).square().mean()
        >>> loss.backward()
        >>> offloader.stats.bytes_offloaded > 0
        True
        >>> offloader.close()
    """

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        *,
        offload_layers: LayerSelection = "auto",
        min_tensor_bytes: int = 256 * 1024,
        prefetch_layers: int | None = None,
        pin_memory: bool = True,
        host_memory_limit: int | None = None,
        double_buffering: bool = False,
        tensor_filter: Callable[[torch.Tensor], bool] | None = None,
        timing: bool = False,
        max_slowdown: float = 0.03,
        compress: str | None = None,
        compress_filter: Callable[[torch.Tensor], bool] | None = None,
        config: OffloadConfig | None = None,
    ) -> None:
        given = {
            "offload_layers": offload_layers,
            "min_tensor_bytes": min_tensor_bytes,
            "prefetch_layers": prefetch_layers,
            "pin_memory": pin_memory,
            "host_memory_limit": host_memory_limit,
            "double_buffering": double_buffering,
            "tensor_filter": tensor_filter,
            "timing": timing,
            "max_slowdown": max_slowdown,
            "compress": compress,
            "compress_filter": compress_filter,
        }
        config = _resolve_config(given, config)
        layers = _check_layers(layers, config)
        self._order = CallOrder(layers)  # raises for a module listed twice
        self.config = config
        self._layers = layers
        self._runtime = Runtime(config)
        self._step: Step | None = None  # the forward in progress
        self._last: Step | None = None  # the most recent forward (its stats)
        self._unfinished: list[Step] = []  # earlier forwards whose backward has not run
        self._layer_hooks = LayerHooks(layers)
        #: the Step of the next forward, made when the last one ended (__exit__)
        self._next: Step | None = None
        self._saved_hooks: Any = None
        #: our saved-tensor hooks are popped for the layer call in progress (a call
        #: that is not offloaded: ``_layer_start``)
        self._aside = False
        self._calls: list[Any] = list(layers)  # the modules called by the last forward
        self._groups_this_entry = 0
        self._warned: set[str] = set()
        self._saved_elsewhere = False  # a layer's saves went to other saved-tensor hooks
        self._closed = False
        # profile_step's baseline: while set, `with offloader:` does nothing at all
        # (no hooks), and only counts its entries.
        self._disabled = False
        self._disabled_entries = 0
        self._auto = AutoPolicy() if config.offload_layers == "auto" else None
        #: calls run recomputed when host or device memory is short (Note [recomputed
        #: calls]); the most bytes one offloaded call sent, this forward and the last
        self._recomputed = RecomputedCalls()
        self._call_bytes = 0
        self._last_call_bytes = 0
        #: whether the last plan recomputed the first call ("auto" decides at that call's
        #: start, too late for that call: Note [recomputed calls])
        self._first_recomputed = False

    # ---- the context ----------------------------------------------------------------

    def _make_step(self) -> Step:
        """A Step planned for the calls of the last complete forward (of ``layers`` at
        first): which calls are offloaded depends only on their position in a forward."""
        plan = plan_forward(self.config.offload_layers, self._calls, self.config.prefetch_layers)
        return Step(self._runtime, plan)

    def _new_step(self) -> Step:
        """The Step of the forward that starts now: the one prepared when the last
        forward ended, or a new one."""
        step, self._next = self._next, None
        if step is None:
            step = self._make_step()
        if _device.capturing():  # a whole-step CUDA graph (Note [release order])
            step.capture = "step"
        self._step = self._last = step
        return step

    def _end_forward(self, step: Step) -> None:
        if step.untracked is not None and self._layer_hooks.partial:
            # the calls after the first ran without our hooks (Note [untracked calls]):
            # taken to be the last forward's
            step.untracked.extend(self._calls[1:])
        step.finish_forward()
        if step.groups:
            self._calls = step.calls()
            self._groups_this_entry += len(self._calls)
            if not step.finished:
                self._unfinished.append(step)
            if step.plan.offloaded and not any(g.stats.bytes_offloaded for g in step.groups):
                message = _nothing_offloaded(step, self._saved_elsewhere)
                self._warn_once("nothing_offloaded", message)
            elif self.config.compress is not None and "compress" not in self._warned:
                note = _nothing_compressed(step, self.config)
                if note is not None:
                    self._warn_once("compress", note)

    def __enter__(self) -> ActivationOffloader:
        if self._disabled:
            self._disabled_entries += 1
            return self
        _context.claim(self, "ActivationOffloader")
        try:
            self._closed = False
            # Earlier forwards whose backward ran (or whose graph is gone) need no hooks:
            # remove what is left of them, so nothing piles up on tensors that live
            # across steps (a fixed batch, a parameter passed to every layer).
            self._unfinished = _prune(self._unfinished)
            self._groups_this_entry = 0
            last = self._last
            step = self._new_step()
            # Note [untracked calls]: a forward expected to offload nothing hooks its
            # first layer only (the others are hooked if it offloads after all)
            first = None
            if step.plan.offloads_nothing or (last is not None and last.untracked is not None):
                first = self._calls[0]
            self._layer_hooks.add(self._layer_start, self._layer_end, first)
            if self._call_bytes:
                self._last_call_bytes, self._call_bytes = self._call_bytes, 0
            self._before_call(step, 0)
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_hook)
            self._saved_hooks.__enter__()
        except BaseException:
            self._layer_hooks.release()
            self._step = None
            _context.release(self)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._disabled:
            return
        step, self._step = cast(Step, self._step), None  # set by __enter__
        try:
            if exc_type is None:
                self._end_forward(step)
                # The next forward's Step, made now: the host is ahead of the device here
                # (this forward's kernels are still queued), while at the next entry
                # every microsecond of host work delays the step's first kernels. It
                # depends only on _calls (set by _end_forward) and the frozen config.
                self._next = self._make_step()
                if self._groups_this_entry == 0 and not self._layer_hooks.partial:
                    message = _NOT_CALLED.format(n=len(self._layers))
                    if _dynamo_compiled_something():
                        message += _NOT_CALLED_COMPILED
                    self._warn_once("not_called", message)
            else:
                step.abort()
                self._unfinished = _prune(self._unfinished)
        finally:
            if len(self._recomputed):
                self._recomputed.deactivate()
            self._layer_hooks.release()
            hooks, self._saved_hooks = self._saved_hooks, None
            _context.release(self)
            if self._aside:  # a layer that is not offloaded raised: our hooks are off
                self._aside = False
            elif hooks is not None:
                hooks.__exit__(exc_type, exc, tb)

    def _hold_layer_hooks(self, hold: bool) -> None:
        """An attachment starts (``hold``) or stops keeping the layer hooks registered
        between forwards (``LayerHooks.hold``)."""
        self._layer_hooks.hold(hold, self._layer_start, self._layer_end, self._step is None)

    def _pack(self, t: torch.Tensor) -> Any:
        return self._step.pack(t)  # type: ignore[union-attr]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_at_caller(message)

    # ---- results ----------------------------------------------------------------------

    @property
    def stats(self) -> OffloadStats:
        """:class:`OffloadStats` of the most recent forward (updated by its backward).

        With ``timing=True`` reading it waits on the host for the recorded copies.
        """
        step = self._last
        return OffloadStats() if step is None else step.read_stats()

    @property
    def last_step(self) -> StepView | None:
        """A read-only view of the most recent forward and its backward, per layer call
        (planned, offloaded, released, reloaded, dropped, its buckets of small tensors;
        the waits; the auto decision and what the auto policy remembers): a frozen
        :class:`~offload.activations._view.StepView` taken when read, or ``None`` before
        the first forward. Read inside a forward, it shows that forward so far
        (``in_progress``). With ``timing=True`` reading it waits on the host for the
        recorded copies, as :attr:`stats` does."""
        step = self._last
        if step is None:
            return None
        return view_of(step, in_progress=step is self._step, policy=self._auto)

    def report(self, console: Any = None) -> None:
        """Print :attr:`stats` as a table (rich); before any forward, say so instead."""
        if self._last is None:
            from rich.console import Console

            (console or Console()).print(_NO_FORWARD_YET)
            return
        self.stats.report(console)

    def close(self) -> None:
        """Free the host memory pool. Idempotent; also runs on garbage collection.

        Tensors still saved by a graph keep their own host blocks alive until the graph
        is freed; the offloader can be entered again (a new pool is made on demand).
        Host memory bound to captured CUDA graphs stays (a graph may still be replayed)
        until :meth:`free_graph_memory` or until the offloader is deleted.
        """
        if self._closed:
            return
        self._closed = True
        self._next = None
        self._recomputed.remove()
        self._runtime.close()

    def free_graph_memory(self) -> int:
        """Release the host memory that CUDA graphs captured with this offloader write
        at every replay (``torch.cuda.graph`` with the offloader entered inside, or
        :func:`offload.make_graphed_callables`). Call it only once those graphs will
        not be replayed again (delete them first): a replay afterwards would write host
        memory the pool may have handed to someone else. Deleting the offloader does the
        same, so keep it referenced while its graphs are replayed.

        Returns:
            The bytes released (0 when no graph was captured).
        """
        return self._runtime.free_graph_memory()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={getattr(self.config, f.name)!r}" for f in dataclasses.fields(self.config)
        )
        return f"ActivationOffloader({len(self._layers)} layers, {fields})"

    def _capture_view(self) -> CaptureView:
        """What per-layer graph capture (offload/activations/_graphs.py) reads."""
        return CaptureView(tuple(self._layers), self._runtime, self.config.offload_layers)

    def _show_stats_of(self, source: Any) -> None:
        self._last = source  # stats reads source.read_stats(): the captured layer calls

    # ---- attached to a model's forward ------------------------------------------------

    def attach(self, model: torch.nn.Module) -> AttachHandle:
        """Enter this offloader around every forward of ``model``, for training loops you
        do not own (Hugging Face ``Trainer``, Lightning, accelerate).

        A forward pre-hook on ``model`` enters the context (as ``with offloader:``
        would) and a forward hook leaves it when the forward returns. The hook is
        registered with ``always_call=True``, so it also runs when the forward raises
        an ``Exception``: the context is then left with that exception, which frees
        everything the failed forward offloaded and removes the hooks the context
        installed. (A ``KeyboardInterrupt`` bypasses module hooks: after catching one
        during a forward, call ``handle.remove()``, which leaves the context the same
        way.) While attached, each of ``layers`` also keeps the offloader's two
        layer hooks between forwards (``with offloader:`` alone registers them at entry
        and removes them at exit): they return at once outside a training forward, and
        registering them once takes that work off every step's start. ``remove()``
        takes them off with the model's. The backward runs outside the context, as usual.
        Whatever the forward computes after the layers (the loss of a Hugging Face
        ``*ForCausalLM``) is inside the context and stays on the device (reason
        ``outside_layers``).

        A forward is left alone (nothing entered, nothing left) when:

        * the offloader is already entered, by ``with offloader:`` or by an outer call of
          ``model`` (``model.forward`` calling ``model``, generation loops): calls
          nest, and only the outermost one enters and leaves;
        * gradients are disabled (``torch.no_grad()``, ``torch.inference_mode()``:
          evaluation, generation): nothing is saved for backward, and :attr:`stats`
          keeps describing the last training forward.

        One forward at a time per offloader, as with ``with offloader:``. Copies of
        ``model`` (``copy.deepcopy``, pickling) are not attached.

        Args:
            model: the module whose forward runs ``layers`` (typically the whole model,
                the one the training loop calls).

        Returns:
            An :class:`AttachHandle`: ``handle.remove()`` removes both hooks
            (idempotent); ``with offloader.attach(model):`` removes them at the end
            of the block. :meth:`detach` removes every attachment of this offloader.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: ``model`` is already attached to this offloader.

        Example:
            >>> layers = [torch.nn.Linear(512, 512) for _ in range(4)]
            >>> model = torch.nn.Sequential(*layers)
            >>> offloader = ActivationOffloader(layers, min_tensor_bytes=0)
            >>> handle = offloader.attach(model)
            >>> x = torch.randn(64, 512, requires_grad=True)
            >>> loss = model(x).square().mean()  # the forward offloads; no `with` needed
            >>> loss.backward()
            >>> offloader.stats.bytes_offloaded > 0
            True
            >>> handle.remove()
            >>> offloader.close()
        """
        return _attach.attach(self, model)

    def detach(self) -> None:
        """Remove every attachment made by :meth:`attach` (``remove()`` on each handle).

        Idempotent. A forward that an attachment entered and that has not returned yet is
        left as if it had raised (what it offloaded is freed).
        """
        _attach.detach(self)


def _resolve_config(given: dict[str, Any], config: OffloadConfig | None) -> OffloadConfig:
    """The offloader's config: ``config``, or one made of the keywords ``given``.

    Raises:
        TypeError: ``config`` is not an :class:`OffloadConfig`, or it is given together
            with keywords changed from their defaults.
    """
    if config is not None:
        if not isinstance(config, OffloadConfig):
            raise TypeError(
                f"config must be an offload.OffloadConfig or None; got {type(config).__name__}"
            )
        # A keyword left at its default cannot be told from one not given.
        changed = sorted(k for k, v in given.items() if v is not _DEFAULTS[k] and v != _DEFAULTS[k])
        if changed:
            raise TypeError(
                f"pass either config= or keyword settings, not both (got config and "
                f"{changed}); use dataclasses.replace(config, ...) to combine"
            )
    else:
        config = OffloadConfig(**given)
    return config


def _check_layers(layers: Any, config: OffloadConfig) -> list[torch.nn.Module]:
    """``layers`` as a list, checked against ``config.offload_layers``.

    Raises:
        TypeError: ``layers`` is not a sequence of ``nn.Module``.
        ValueError: ``layers`` is empty, or the selection does not fit it.
    """
    if isinstance(layers, torch.nn.Module) and not isinstance(
        layers, (torch.nn.ModuleList, torch.nn.Sequential)
    ):
        raise TypeError(
            f"layers must be a sequence of nn.Module (the repeated blocks, e.g. "
            f"model.layers or offload.find_layers(model)); got a single "
            f"{type(layers).__name__}"
        )
    if not isinstance(layers, (Sequence, torch.nn.ModuleList, torch.nn.Sequential)):
        raise TypeError(f"layers must be a sequence of nn.Module; got {type(layers).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; pass the model's repeated blocks, in order")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"layers[{i}] must be an nn.Module; got {type(layer).__name__}")
    check_selection(config.offload_layers, len(layers))
    if config.offload_layers in (None, "all", "auto") and len(layers) == 1:
        warn_at_caller(
            f"offload: ActivationOffloader got one layer and offload_layers="
            f"{config.offload_layers!r} (never the last call), so nothing will be "
            f"offloaded. Pass the model's repeated "
            "blocks (offload.find_layers(model), e.g. model.model.layers), or "
            "offload_layers=1 to offload that one layer."
        )
    return layers


def _dynamo_compiled_something() -> bool:
    """Whether dynamo compiled a frame in this process (without importing it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and bool(utils.counters["frames"].get("ok"))


def _nothing_compressed(step: Step, config: OffloadConfig) -> str | None:
    """Why ``compress`` compressed none of the bytes ``step`` offloaded (a warning's
    text), or ``None`` when it compressed some, nothing was offloaded, or a
    ``compress_filter`` chose (its choice, even of nothing, is the caller's)."""
    stats = step.stats
    if config.compress_filter is not None or stats.compress_bytes_before:
        return None
    if not any(g.stats.bytes_offloaded for g in step.groups):
        return None
    sent = ", ".join(sorted(stats.bytes_by_dtype)) or "none"
    return (
        f"offload: compress={config.compress!r} compressed nothing in this forward: "
        f"without a compress_filter it compresses bfloat16 and float16 tensors only, "
        f"and every offloaded tensor was sent exactly (dtypes: {sent}). Run the layers "
        f"in bfloat16 or float16 (or under autocast), pass compress_filter=lambda t: "
        f"True to compress float32 too, or drop compress."
    )


def _nothing_offloaded(step: Step, saved_elsewhere: bool) -> str:
    """Why the layers selected in ``step`` offloaded no byte (a warning's text)."""
    from offload.activations._placement import summary_hint

    kept: dict[str, int] = {}
    for g in step.groups:
        if g.offload:
            for why_kept, n in g.stats.bytes_kept.items():
                kept[why_kept] = kept.get(why_kept, 0) + n
    # parameters never travel: name what kept the rest, when anything else was kept
    actionable = {r: n for r, n in kept.items() if n and r != "parameter"}
    pool = actionable or {r: n for r, n in kept.items() if n}
    reason = max(pool, key=pool.__getitem__) if pool else None
    if reason is None and saved_elsewhere:
        why = (
            "the tensors they saved went to other saved-tensor hooks pushed inside "
            "the layers (see the warning about them)"
        )
    elif reason is None:
        why = "the selected layers saved no tensor for backward (is grad enabled?)"
    else:
        why = f"everything they saved was kept on the device, mostly '{reason}'"
        hint = summary_hint(reason)
        if hint:
            why += f": {hint}"
    return (
        f"offload: {len(step.plan.offloaded)} layer call(s) were selected for "
        f"offloading but no bytes were offloaded; {why}."
    )


# the pack hook: never a frame for dynamo, whatever the order of compiled plain and
# offloaded steps (offload/_core/_dynamo.py)
_dynamo.opaque(ActivationOffloader._pack)


class no_offload(contextlib.ContextDecorator):
    """Keep tensors saved in this block (or decorated function) on the device.

    Saves made inside are counted under the reason ``opted_out``. Works as a context
    manager and as a decorator; nests; applies to the calling thread only.

    Example:
        >>> @no_offload()
        ... def head(x):
        ...     return x.sigmoid()
    """

    def __enter__(self) -> no_offload:
        _enter_no_offload()
        return self

    def __exit__(self, *exc: Any) -> None:
        _exit_no_offload()
