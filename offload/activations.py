"""Activation offloading: :class:`ActivationOffloader`, :func:`no_offload` and the
TransformerEngine-compatible :func:`get_cpu_offload_context`."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload import _device, _dynamo, _packing
from offload._auto_policy import AutoPolicy
from offload._diagnose import CallOrder, saved_elsewhere
from offload._handles import unpack_hook
from offload._plan import Schedule, check_selection, plan_forward
from offload._runtime import Runtime
from offload._runtime import enter_no_offload as _enter_no_offload
from offload._runtime import exit_no_offload as _exit_no_offload
from offload._step import Step
from offload._warn import warn_at_caller
from offload.config import LayerSelection, OffloadConfig
from offload.profiling import OffloadStats

__all__ = [
    "ActivationOffloader",
    "ManualOffloadSynchronizer",
    "get_cpu_offload_context",
    "mark_not_offload",
    "no_offload",
    "start_offload",
]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}

# The offload context entered on each thread, if any. Saved-tensor hooks do not nest:
# only the innermost pair sees tensors, so a second context inside a first would leave
# the outer one silently empty. Entering one while another is active raises instead.
_active = threading.local()


#: ``(pack, unpack)`` of the innermost saved-tensor hooks of the thread, or None (private:
#: no public API tells; ActivationOffloader._hooks_on_top falls back when it is missing)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _claim_thread(owner: object, what: str) -> None:
    current = getattr(_active, "owner", None)
    if current is owner:
        raise RuntimeError(
            f"this {what} is already entered on this thread; nested `with` blocks of the "
            f"same offloader are not supported (exit the first one before entering again)"
        )
    if current is not None:
        raise RuntimeError(
            f"another offload context ({type(current).__name__}) is already active on this "
            f"thread. Saved-tensor hooks do not nest (only the innermost would see the "
            f"tensors and the outer one would silently offload nothing): use one "
            f"ActivationOffloader over all the layers and choose with offload_layers"
        )
    _active.owner = owner


def _release_thread(owner: object) -> None:
    if getattr(_active, "owner", None) is owner:
        _active.owner = None


class ActivationOffloader:
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
            (docs/decisions.md has the measurement).
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
            to its dtype (exact statement: ``offload/_compress.py``); an inf or NaN
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

    Invariants (``# Note [release order]`` in ``offload/_step.py`` says why each
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
        if config is not None:
            if not isinstance(config, OffloadConfig):
                raise TypeError(
                    f"config must be an offload.OffloadConfig or None; got {type(config).__name__}"
                )
            # A keyword left at its default cannot be told from one not given.
            changed = sorted(
                k for k, v in given.items() if v is not _DEFAULTS[k] and v != _DEFAULTS[k]
            )
            if changed:
                raise TypeError(
                    f"pass either config= or keyword settings, not both (got config and "
                    f"{changed}); use dataclasses.replace(config, ...) to combine"
                )
        else:
            config = OffloadConfig(**given)
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
        self._order = CallOrder(layers)  # raises for a module listed twice
        check_selection(config.offload_layers, len(layers))
        if config.offload_layers in (None, "all", "auto") and len(layers) == 1:
            warn_at_caller(
                f"offload: ActivationOffloader got one layer and offload_layers="
                f"{config.offload_layers!r} (never the last call), so nothing will be "
                f"offloaded. Pass the model's repeated "
                "blocks (offload.find_layers(model), e.g. model.model.layers), or "
                "offload_layers=1 to offload that one layer."
            )
        self.config = config
        self._layers = layers
        self._runtime = Runtime(config)
        self._step: Step | None = None  # the forward in progress
        self._last: Step | None = None  # the most recent forward (its stats)
        self._unfinished: list[Step] = []  # earlier forwards whose backward has not run
        self._hooks: list[Any] = []
        #: attachments that keep the layer hooks registered between forwards (attach())
        self._hook_holders = 0
        #: the Step of the next forward, made when the last one ended (_prepare_next)
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

    # ---- the context ----------------------------------------------------------------

    def _make_step(self) -> Step:
        """A Step planned for the calls of the last complete forward (of ``layers`` at
        first): which calls are offloaded depends only on their position in a forward."""
        plan = plan_forward(self.config.offload_layers, self._calls, self.config.prefetch_layers)
        return Step(self._runtime, plan)

    def _prepare_next(self) -> None:
        """Make the next forward's Step now, at the end of this forward: the host is
        then ahead of the device (the forward's kernels are still queued), while at the
        next entry every microsecond of host work delays the step's first kernels. The
        Step depends only on ``self._calls`` and the (frozen) config, and only
        ``_end_forward`` changes ``_calls``: call this after it."""
        self._next = self._make_step()

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
        step.finish_forward()
        if step.groups:
            self._calls = [g.module for g in step.groups]
            self._groups_this_entry += len(step.groups)
            if not step.finished:
                self._unfinished.append(step)
            if step.plan.offloaded and not any(g.stats.bytes_offloaded for g in step.groups):
                self._warn_nothing_offloaded(step)

    def __enter__(self) -> ActivationOffloader:
        if self._disabled:
            self._disabled_entries += 1
            return self
        _claim_thread(self, "ActivationOffloader")
        try:
            self._closed = False
            # Earlier forwards whose backward ran (or whose graph is gone) need no hooks:
            # remove what is left of them, so nothing piles up on tensors that live
            # across steps (a fixed batch, a parameter passed to every layer).
            self._unfinished = _prune(self._unfinished)
            self._groups_this_entry = 0
            self._new_step()
            if not self._hooks:  # registered already while attached (attach())
                self._add_layer_hooks()
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_hook)
            self._saved_hooks.__enter__()
        except BaseException:
            if not self._hook_holders:
                self._remove_layer_hooks()
            self._step = None
            _release_thread(self)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._disabled:
            return
        step, self._step = self._step, None
        try:
            if exc_type is None:
                self._end_forward(step)
                self._prepare_next()
                if self._groups_this_entry == 0:
                    self._warn_once(
                        "not_called",
                        f"offload: none of the {len(self._layers)} layers given to "
                        f"ActivationOffloader ran inside `with offloader:`, so nothing was "
                        f"offloaded. Pass the modules the forward calls (for a Hugging Face "
                        f"model, offload.find_layers(model)), and run the forward inside "
                        f"the `with` block.",
                    )
            else:
                step.abort()
                self._unfinished = _prune(self._unfinished)
        finally:
            if not self._hook_holders:
                self._remove_layer_hooks()
            hooks, self._saved_hooks = self._saved_hooks, None
            _release_thread(self)
            if self._aside:  # a layer that is not offloaded raised: our hooks are off
                self._aside = False
            elif hooks is not None:
                hooks.__exit__(exc_type, exc, tb)

    def _add_layer_hooks(self) -> None:
        """Register the layer-boundary hooks: a forward pre-hook and a forward hook on
        each layer. ``with offloader:`` registers them at entry and removes them at exit
        (nothing of the offloader stays on the modules); while the offloader is attached
        to a model they stay registered between forwards (outside a forward they return
        at once), which takes their registration off the step's start."""
        for module in dict.fromkeys(self._layers):  # each module once, in order
            self._hooks.append(
                module.register_forward_pre_hook(
                    _ModuleHook(self._layer_start, arity=3), with_kwargs=True
                )
            )
            self._hooks.append(
                module.register_forward_hook(_ModuleHook(self._layer_end, arity=4), with_kwargs=True)
            )

    def _remove_layer_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hold_layer_hooks(self, hold: bool) -> None:
        """An attachment starts (``hold``) or stops keeping the layer hooks registered
        between forwards; the last one to stop removes them unless a forward is running
        (its exit does)."""
        if hold:
            self._hook_holders += 1
            if not self._hooks:
                self._add_layer_hooks()
            return
        self._hook_holders -= 1
        if not self._hook_holders and self._step is None:
            self._remove_layer_hooks()

    def _pack(self, t: torch.Tensor) -> Any:
        return self._step.pack(t)  # type: ignore[union-attr]

    def _layer_start(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        step = self._step
        if step is None or getattr(_active, "owner", None) is not self:
            # outside a forward, or a call made on another thread (a second offloader
            # over the same modules, data-parallel replicas): not ours
            return
        groups = step.groups
        if step.open is None and len(groups) >= len(self._layers) and module is groups[0].module:
            # The first layer again after a whole forward: the next forward (another
            # micro-batch) in the same context entry. It gets its own plan, so the
            # calls offloaded do not depend on how many forwards an entry holds.
            self._end_forward(step)
            step = self._new_step()
        if self._auto is not None and not step.groups:
            self._auto.prepare(self, step, (args, kwargs))
        if step.open is None and "order" not in self._warned:
            message = self._order.check(len(step.groups), module)
            if message is not None:
                self._warn_once("order", message)
        step.open_group(module, (args, kwargs))
        group = step.open
        if (
            group is not None
            and not group.offload
            and step.depth == 0
            and not step.probe
            and not self._aside
            and self._hooks_on_top()
        ):
            # A layer call that is not offloaded runs without our saved-tensor hooks:
            # every tensor it saves would be kept anyway, and a Python hook per saved
            # tensor is what a launch-bound model pays for. Autograd then saves them
            # itself (with its own in-place checks); they are not counted in the stats.
            self._saved_hooks.__exit__(None, None, None)
            self._aside = True

    def _hooks_on_top(self) -> bool:
        """Whether our saved-tensor hooks are the innermost on this thread (only then
        may they be popped: hooks pushed inside ``with offloader:`` by the caller, e.g.
        non-reentrant checkpointing around a layer, must stay). PyTorch has no public
        way to ask; without the private one, the hooks stay (correct, only slower)."""
        top = _TOP_HOOKS
        if top is None or self._saved_hooks is None:
            return False
        current = top(False)
        return current is not None and current[0] is self._saved_hooks.pack_hook

    def _layer_end(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        step = self._step
        if step is not None and getattr(_active, "owner", None) is self:
            group = step.open if step.depth == 0 else None
            if self._aside and step.depth == 0:
                self._saved_hooks.__enter__()  # type: ignore[union-attr]
                self._aside = False
            step.close_group(output)
            if (
                group is not None
                and group.offload
                and not step.probe
                and "saved_elsewhere" not in self._warned
            ):
                stats = group.stats  # nothing saved through our hooks: whose were they?
                if (
                    not stats.bytes_offloaded
                    and not any(stats.bytes_kept.values())
                    and torch.is_grad_enabled()
                ):
                    self._warned.add("saved_elsewhere")  # one look: it walks the graph
                    message = saved_elsewhere(group.index, module, output)
                    if message is not None:
                        self._saved_elsewhere = True
                        warn_at_caller(message)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_at_caller(message)

    def _warn_nothing_offloaded(self, step: Step) -> None:
        from offload._placement import summary_hint

        kept: dict[str, int] = {}
        for g in step.groups:
            if g.offload:
                for reason, n in g.stats.bytes_kept.items():
                    kept[reason] = kept.get(reason, 0) + n
        # parameters never travel: name what kept the rest, when anything else was kept
        actionable = {r: n for r, n in kept.items() if n and r != "parameter"}
        pool = actionable or {r: n for r, n in kept.items() if n}
        reason = max(pool, key=pool.__getitem__) if pool else None
        if reason is None and self._saved_elsewhere:
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
        self._warn_once(
            "nothing_offloaded",
            f"offload: {len(step.plan.offloaded)} layer call(s) were selected for "
            f"offloading but no bytes were offloaded; {why}.",
        )

    # ---- results ----------------------------------------------------------------------

    @property
    def stats(self) -> OffloadStats:
        """:class:`OffloadStats` of the most recent forward (updated by its backward).

        With ``timing=True`` reading it waits on the host for the recorded copies.
        """
        step = self._last
        return OffloadStats() if step is None else step.read_stats()

    def report(self, console: Any = None) -> None:
        """Print :attr:`stats` as a table (rich); before any forward, say so instead."""
        if self._last is None:
            from rich.console import Console

            (console or Console()).print(
                "offload: no forward has run under this offloader yet, so there is "
                "nothing to report. Run a forward inside `with offloader:` (and its "
                "backward), then call report()."
            )
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
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"attach() takes the nn.Module whose forward runs the layers; got "
                f"{type(model).__name__}"
            )
        # Weak references: the model's hooks keep a handle alive, and a strong reference
        # back from the offloader would make a cycle only the garbage collector frees.
        attachments: list[weakref.ref[AttachHandle]] = self.__dict__.setdefault("_attachments", [])
        attachments[:] = [r for r in attachments if r() is not None]
        for ref in attachments:
            other = ref()
            if other is not None and other.model is model:
                raise ValueError(
                    f"this {type(model).__name__} is already attached to this offloader; "
                    f"call remove() on the first handle (or offloader.detach()) before "
                    f"attaching it again"
                )
        handle = AttachHandle(self, model)
        attachments.append(weakref.ref(handle))
        return handle

    def detach(self) -> None:
        """Remove every attachment made by :meth:`attach` (``remove()`` on each handle).

        Idempotent. A forward that an attachment entered and that has not returned yet is
        left as if it had raised (what it offloaded is freed).
        """
        for ref in list(self.__dict__.get("_attachments", ())):
            handle = ref()
            if handle is not None:
                handle.remove()


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


# --------------------------------------------------------------------------------------
# TransformerEngine-compatible manual API


class _ManualContext:
    """One ``with`` entry = one group; ``model_layers`` entries make one forward.

    ``manual=True`` (``manual_synchronization=True``): every group is held for the
    :class:`ManualOffloadSynchronizer`; nothing is released or reloaded on a schedule."""

    def __init__(
        self,
        num_layers: int,
        model_layers: int,
        config: OffloadConfig,
        *,
        manual: bool = False,
        offload_stream: Any = None,
        retain_pinned_cpu_buffers: bool = False,
    ) -> None:
        self.num_layers = num_layers
        self.model_layers = model_layers
        self.runtime = Runtime(
            config, offload_stream=offload_stream, retain_host=retain_pinned_cpu_buffers
        )
        self.config = config
        self.manual = manual
        self.step: Step | None = None
        self.forwards = 0  # forwards started so far; the latest is number forwards - 1
        #: manual mode: the forwards the synchronizer can still name, by number
        self.by_number: dict[int, Step] = {}
        self._unfinished: list[Step] = []
        self._hooks: Any = None

    def _new_forward(self) -> Step:
        if self.manual:
            n = self.model_layers
            every = frozenset(range(n))
            plan = Schedule(n, every, {}, {}, lambda i, m: True)  # no release, no reload point
        else:
            plan = plan_forward(
                self.num_layers, [None] * self.model_layers, self.config.prefetch_layers
            )
        step = self.step = Step(self.runtime, plan)
        if _device.capturing():
            step.capture = "step"
        if self.manual:
            step.manual = True
            self.by_number = {k: v for k, v in self.by_number.items() if not _forward_over(v)}
            self.by_number[self.forwards] = step
        self.forwards += 1
        return step

    def __enter__(self) -> _ManualContext:
        _claim_thread(self, "get_cpu_offload_context() context")
        try:
            step = self.step
            if step is None or len(step.groups) >= self.model_layers:
                # A new forward: hooks of earlier forwards whose backward ran go now.
                if step is not None:
                    self._unfinished.append(step)
                self._unfinished = _prune(self._unfinished)
                step = self._new_forward()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(step.pack, unpack_hook)
            self._hooks.__enter__()
            step.open_group(None)
        except BaseException:
            hooks, self._hooks = self._hooks, None
            if hooks is not None:
                hooks.__exit__(None, None, None)
            _release_thread(self)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        step = self.step
        try:
            if exc_type is not None:
                step.abort()
                self.step = None
                return
            step.close_group()
            if len(step.groups) >= self.model_layers:
                step.finish_forward()
        finally:
            hooks, self._hooks = self._hooks, None
            _release_thread(self)
            hooks.__exit__(exc_type, exc, tb)

    def sync(self, output: Any) -> Any:
        """Mark the end of the group just closed; returns ``output`` unchanged."""
        step = self.step
        if step is not None and step.groups:
            step.register_trigger(len(step.groups) - 1, output)
        return output

    @property
    def stats(self) -> OffloadStats:
        step = self.step
        return OffloadStats() if step is None else step.read_stats()


def _forward_over(step: Step) -> bool:
    """A manual-mode forward with nothing left to move: it ended, and no tensor it saved
    is alive (its backward ran, its graph was freed, or nothing it saved qualified)."""
    if step.aborted:
        return True
    if not step.forward_done:
        return False
    for g in step.groups:
        if g.live or g.device_refs or any(ref() is not None for ref, *_ in g.held):
            return False
    return True


_PHASE_NEEDED = {
    "start_offload_layer": ("saved", "no offload was started for it"),
    "release_activation_forward_gpu_memory": (
        "offload_started",
        "start_offload_layer was called for it and it was not released yet",
    ),
    "start_reload_layer": (
        "released",
        "release_activation_forward_gpu_memory was called for it and no reload started",
    ),
}


class ManualOffloadSynchronizer:
    """The third value of ``get_cpu_offload_context(..., manual_synchronization=True)``:
    the caller decides when each layer's activations are copied out, freed on the device
    and brought back (TransformerEngine's ``ManualOffloadSynchronizer``).

    In this mode every save of a layer stays on the device (counted ``not_selected``)
    until :meth:`start_offload_layer` names the layer; a layer never named is never
    offloaded. Then, per layer and forward, in this order and once each:

    1. :meth:`start_offload_layer` -- allocate host blocks for its saves and issue their
       device-to-host copies (after the work queued so far on the compute stream);
       record the event that marks their end.
    2. :meth:`release_activation_forward_gpu_memory` -- the compute stream waits for
       that event (the host does not), then the device references are dropped: the
       caching allocator may reuse the blocks for later kernels, which run behind the
       wait.
    3. :meth:`start_reload_layer` -- issue the host-to-device copies into fresh buffers;
       each saved tensor's first unpack in the backward makes the compute stream wait
       for its copy.

    Skipping step 2 keeps the device copies (its saves are then reloaded on demand if
    step 3 is skipped too); skipping step 3 reloads on demand at the first unpack.

    ``layer_id`` is the position of the ``with`` entry within its forward (0 to
    ``model_layers - 1``). ``forward`` picks the forward: ``None`` (default) the latest
    one started, else its number (:attr:`forward` was that number while it ran; forwards
    are numbered from 0 in the order they start). Several forwards can be in flight at
    once (pipeline schedules such as 1F1B): each has its own layers. A forward none of
    whose saved tensors is alive any more (its backward ran, its graph was freed, or
    nothing it saved qualified) is over: calls naming it do nothing.

    Raises (each method):
        TypeError: ``layer_id`` or ``forward`` is not an int.
        ValueError: ``layer_id`` is outside ``[0, model_layers)``, or ``forward`` names
            a forward that has not started.
        RuntimeError: the layer has not run yet in that forward, or is still running
            (inside its ``with`` block); or the call is out of order (a second start, a
            release before the start, a reload before the release).
    """

    def __init__(self, ctx: _ManualContext) -> None:
        self._ctx = ctx

    @property
    def offload_stream(self) -> Any:
        """The ``offload_stream`` given to :func:`get_cpu_offload_context` (``None``:
        the copies use streams of their own)."""
        return self._ctx.runtime.offload_stream

    @property
    def forward(self) -> int | None:
        """The number of the latest forward started (``None`` before the first)."""
        n = self._ctx.forwards
        return n - 1 if n else None

    def _find(self, what: str, layer_id: Any, forward: Any) -> tuple[Step, Any] | None:
        ctx = self._ctx
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(
                f"{what}: layer_id must be an int; got {type(layer_id).__name__} {layer_id!r}"
            )
        if not 0 <= layer_id < ctx.model_layers:
            raise ValueError(
                f"{what}: layer_id={layer_id} is out of range; accepted: 0 <= layer_id < "
                f"model_layers={ctx.model_layers}"
            )
        if forward is None:
            if ctx.forwards == 0:
                raise RuntimeError(
                    f"{what}({layer_id}): no forward has started yet; call it after layer "
                    f"{layer_id}'s `with` block"
                )
            forward = ctx.forwards - 1
        elif isinstance(forward, bool) or not isinstance(forward, int):
            raise TypeError(
                f"{what}: forward must be an int or None; got {type(forward).__name__} {forward!r}"
            )
        elif not 0 <= forward < ctx.forwards:
            raise ValueError(
                f"{what}: forward={forward} has not started; accepted: 0 <= forward < "
                f"{ctx.forwards} (the forwards started so far)"
            )
        step = ctx.by_number.get(forward)
        if step is None or (step is not ctx.step and _forward_over(step)):
            return None
        if layer_id >= len(step.groups):
            raise RuntimeError(
                f"{what}({layer_id}): layer {layer_id} of forward {forward} has not run yet "
                f"({len(step.groups)} of its {ctx.model_layers} layers ran)"
            )
        group = step.groups[layer_id]
        if not group.closed:
            raise RuntimeError(
                f"{what}({layer_id}): layer {layer_id} of forward {forward} is still running; "
                f"call it after the layer's `with` block"
            )
        needed, meaning = _PHASE_NEEDED[what]
        if group.phase != needed:
            raise RuntimeError(
                f"{what}({layer_id}) out of order: layer {layer_id} of forward {forward} is "
                f"in state {group.phase!r}; this call needs {needed!r} ({meaning}). Order "
                f"per layer: start_offload_layer, release_activation_forward_gpu_memory, "
                f"start_reload_layer, once each"
            )
        return step, group

    def state(self, layer_id: int, forward: int | None = None) -> str:
        """Where layer ``layer_id`` of a forward stands: ``"saved"`` (nothing started),
        ``"offload_started"``, ``"released"``, ``"reload_started"``; ``"over"`` for a
        forward that is over, ``"not_run"`` for a layer that has not run yet."""
        ctx = self._ctx
        n = ctx.forwards - 1 if forward is None else forward
        step = ctx.by_number.get(n)
        if step is None or (step is not ctx.step and _forward_over(step)):
            return "over"
        if not 0 <= layer_id < len(step.groups):
            return "not_run"
        return step.groups[layer_id].phase

    def stats(self, forward: int | None = None) -> OffloadStats:
        """The :class:`OffloadStats` of a forward (default: the latest one started)."""
        ctx = self._ctx
        n = ctx.forwards - 1 if forward is None else forward
        step = ctx.by_number.get(n)
        return OffloadStats() if step is None else step.read_stats()

    def start_offload_layer(self, layer_id: int, *, forward: int | None = None) -> None:
        """Issue the device-to-host copies of layer ``layer_id``'s saved tensors.

        They start after the work queued so far on the compute stream (so after every
        kernel that wrote them) on the copy stream (``offload_stream`` when given), and
        an event is recorded after them. Call it after the layer's ``with`` block."""
        found = self._find("start_offload_layer", layer_id, forward)
        if found is not None:
            step, group = found
            step.manual_start(group)

    def release_activation_forward_gpu_memory(
        self, layer_id: int, *, forward: int | None = None
    ) -> None:
        """Free layer ``layer_id``'s saved tensors on the device: the compute stream
        (where the layer ran) waits for the copies' event, then the device references are
        dropped. The host does not wait."""
        found = self._find("release_activation_forward_gpu_memory", layer_id, forward)
        if found is not None:
            step, group = found
            step.manual_release(group)

    def start_reload_layer(self, layer_id: int, *, forward: int | None = None) -> None:
        """Issue the host-to-device copies of layer ``layer_id``'s offloaded tensors into
        fresh device buffers; the backward's first use of each waits for its copy on
        the compute stream."""
        found = self._find("start_reload_layer", layer_id, forward)
        if found is not None:
            step, group = found
            step.manual_reload(group)


def _prune(steps: list[Step]) -> list[Step]:
    """Remove the hooks of the finished steps (their backward ran, or their graph is
    gone) and return the others, whose backward is still to come."""
    waiting = []
    for step in steps:
        if step.finished:
            step.remove_hooks()
        else:
            waiting.append(step)
    return waiting


def _identity(x: Any) -> Any:
    return x


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    *,
    retain_pinned_cpu_buffers: bool = False,
    manual_synchronization: bool = False,
    offload_stream: Any = None,
) -> tuple[Any, ...]:
    """TransformerEngine-style manual offloading: ``(context, sync)``, or ``(context,
    sync, synchronizer)`` with ``manual_synchronization=True``.

    Each ``with context:`` entry is one group (one layer); after ``model_layers``
    entries the next entry starts a new forward. The first ``num_layers`` groups of each
    forward are offloaded, with the same schedule as :class:`ActivationOffloader`. Call
    ``x = sync(x)`` on each layer's output after its ``with`` block: it marks the group
    boundary for the backward (reload triggers) and returns ``x`` itself.

    With ``manual_synchronization=True`` there is no schedule: the third value, a
    :class:`ManualOffloadSynchronizer`, starts each layer's copies, releases its device
    memory and starts its reload when the caller says (``start_offload_layer``,
    ``release_activation_forward_gpu_memory``, ``start_reload_layer``), for the latest
    forward or a given one, so several forwards can be in flight (pipeline schedules).

    Args:
        enabled: ``False`` (default) returns ``(contextlib.nullcontext(), identity)``
            (and ``None`` as the third value with ``manual_synchronization=True``).
        num_layers: groups offloaded per forward; ``0 <= num_layers <= model_layers - 1``.
            Default 1. Ignored with ``manual_synchronization=True`` (may be ``None``).
        model_layers: groups per forward. Default 1.
        offload_activations: offload saved activations. Default ``True``.
        offload_weights: also offload the weights of the modules called inside the
            first ``num_layers`` groups, with an :class:`offload.WeightOffloader`
            (``context.weights``) that adopts each module at its first call. Default
            ``False``. With ``manual_synchronization=True`` it has no effect (a warning
            says so; TransformerEngine 2.10 ignores it always).
        double_buffering: as in :class:`ActivationOffloader`. Default ``False``.
        retain_pinned_cpu_buffers: keyword-only. ``True``: the host pool never gives a
            slab back before the context is dropped, so host addresses stay valid from
            one step to the next (what CUDA graphs need); a tensor that would only fit
            by returning empty slabs stays on the device instead (reason
            ``host_limit``). ``False`` (default): the pool still keeps its slabs across
            steps, but when over ``host_memory_limit`` it returns empty slabs too small
            for a request and takes one that fits. (TransformerEngine allocates pinned
            buffers per tensor and frees them after each reload unless this is set;
            our pool reuses its slabs in both cases.)
        manual_synchronization: keyword-only. ``True``: return ``(context, sync,
            synchronizer)``; nothing is offloaded, released or reloaded unless the
            synchronizer says so (``num_layers`` is ignored). Default ``False``.
        offload_stream: keyword-only. A ``torch.cuda.Stream`` on the layers' device that
            carries every device-to-host and host-to-device copy (both directions, as in
            TransformerEngine), so the caller can synchronize with it (``wait_stream``,
            events, ``offload_stream.synchronize()``). Only with
            ``manual_synchronization=True``. Default ``None``: the copies use streams of
            their own.

    Returns:
        ``(context, sync)``; with ``manual_synchronization=True``, ``(context, sync,
        synchronizer)``.

    Raises:
        TypeError: an argument has the wrong type (``offload_stream`` not a
            ``torch.cuda.Stream`` or ``None``).
        ValueError: ``num_layers`` or ``model_layers`` is out of range (without
            ``manual_synchronization``); ``offload_stream`` is given without
            ``manual_synchronization=True`` (TransformerEngine asserts both).
        RuntimeError: ``offload_stream`` is given but CUDA is not available.

    Example:
        >>> ctx, sync = get_cpu_offload_context(True, num_layers=1, model_layers=2)
        >>> layers = [torch.nn.Linear(8, 8) for _ in range(2)]
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         x = layer(x)
        ...     x = sync(x)
        >>> x.sum().backward()

        Manual synchronization (one forward; a pipeline schedule names the forward):

        >>> ctx, sync, sched = get_cpu_offload_context(
        ...     True, model_layers=2, manual_synchronization=True)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> for i, layer in enumerate(layers):
        ...     with ctx:
        ...         x = layer(x)
        ...     x = sync(x)
        ...     sched.start_offload_layer(i)
        >>> for i in range(2):
        ...     sched.release_activation_forward_gpu_memory(i)
        >>> for i in reversed(range(2)):
        ...     sched.start_reload_layer(i)
        >>> x.sum().backward()
    """
    for name, value in (
        ("enabled", enabled),
        ("offload_activations", offload_activations),
        ("offload_weights", offload_weights),
        ("double_buffering", double_buffering),
        ("retain_pinned_cpu_buffers", retain_pinned_cpu_buffers),
        ("manual_synchronization", manual_synchronization),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}")
    for name, value in (("num_layers", num_layers), ("model_layers", model_layers)):
        if name == "num_layers" and value is None and manual_synchronization:
            continue  # ignored in manual mode (TransformerEngine's docs pass none)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if offload_stream is not None and not isinstance(offload_stream, torch.cuda.Stream):
        raise TypeError(
            f"offload_stream must be a torch.cuda.Stream or None; got "
            f"{type(offload_stream).__name__} {offload_stream!r}"
        )
    if not enabled:
        if manual_synchronization:
            return contextlib.nullcontext(), _identity, None
        return contextlib.nullcontext(), _identity
    if model_layers < 1:
        raise ValueError(f"model_layers={model_layers}: must be >= 1")
    if not manual_synchronization and not 0 <= num_layers <= model_layers - 1:  # type: ignore[operator]
        raise ValueError(
            f"num_layers={num_layers}: must satisfy 0 <= num_layers <= model_layers - 1 "
            f"= {model_layers - 1} (as in TransformerEngine; with "
            f"manual_synchronization=True any layer may be offloaded)"
        )
    if offload_stream is not None:
        if not manual_synchronization:
            raise ValueError(
                "offload_stream may be given only with manual_synchronization=True (as in "
                "TransformerEngine); pass offload_stream=None or manual_synchronization=True"
            )
        if not torch.cuda.is_available():
            raise RuntimeError(
                "offload_stream was given but CUDA is not available; pass offload_stream=None"
            )
    if manual_synchronization:
        if offload_weights:
            warn_at_caller(
                "offload: offload_weights=True has no effect with "
                "manual_synchronization=True (TransformerEngine 2.10 ignores it too); only "
                "activations are offloaded"
            )
        if not offload_activations:
            return contextlib.nullcontext(), _identity, None
        config = OffloadConfig(offload_layers=None, double_buffering=double_buffering)
        ctx = _ManualContext(
            0,
            model_layers,
            config,
            manual=True,
            offload_stream=offload_stream,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        )
        return ctx, ctx.sync, ManualOffloadSynchronizer(ctx)
    if not offload_activations:
        pair: tuple[Any, Callable[[Any], Any]] = (contextlib.nullcontext(), _identity)
    else:
        config = OffloadConfig(offload_layers=num_layers, double_buffering=double_buffering)
        ctx = _ManualContext(
            num_layers,  # type: ignore[arg-type]
            model_layers,
            config,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        )
        pair = (ctx, ctx.sync)
    if offload_weights:  # weights too: offload/_weights.py wraps the pair
        from offload._weights import manual_weight_context

        return manual_weight_context(pair, num_layers, model_layers)
    return pair


# --------------------------------------------------------------------------------------
# TransformerEngine's tensor marks


def _parts(t: Any) -> list[torch.Tensor]:
    """The tensors whose attributes TransformerEngine's marks set: a TE quantized
    tensor's data and scale tensors (``prepare_for_saving()``; the object is refilled
    at once), else the tensor itself."""
    if _packing.is_te_quantized(t):
        parts, obj = t.prepare_for_saving()
        obj.restore_from_saved(parts)  # the same tensor objects go back in
        return [p for p in parts if p is not None]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected tensors (or None); got {type(t).__name__} {t!r}")
    return [t]


def mark_not_offload(*tensors: Any) -> None:
    """Keep these tensors on the device whenever they are saved for backward inside an
    offload context (TransformerEngine's ``mark_not_offload``).

    Sets the attribute ``_TE_do_not_offload`` on each tensor (on the data and scale
    tensors of a TransformerEngine quantized tensor, as TransformerEngine does), which
    every offloader of this package honours: the tensor is counted under the keep
    reason ``opted_out``. ``None`` entries are skipped. Works inside and outside any
    offload context; the mark stays with the tensor object.

    Raises:
        TypeError: an entry is neither a tensor, a TE quantized tensor nor ``None``.

    Example:
        >>> t = torch.randn(1024, 1024)
        >>> mark_not_offload(t)
        >>> t._TE_do_not_offload
        True
    """
    for t in tensors:
        if t is None:
            continue
        for part in _parts(t):
            part._TE_do_not_offload = True


def start_offload(*tensors: Any, offload_base_tensor: bool = False) -> None:
    """Say that these tensors are fully computed and may be copied to the host
    (TransformerEngine's ``start_offload``). Safe to call anywhere: outside an offload
    context it only sets the mark below.

    TransformerEngine records an event here that a later copy of the tensor waits for.
    Here the copy of a saved tensor is queued when it is saved and waits for everything
    queued on the compute stream until it is issued, which includes the kernels that
    produced the tensor, so no event is needed; what this call does:

    * Inside an offload context on this thread (an :class:`ActivationOffloader` or
      :func:`get_cpu_offload_context` entry): if a queued copy (not yet issued: copies
      are issued in small batches) reads one of these tensors' storage, the queue is
      issued now, so the copy starts as early as TransformerEngine's would. In manual
      mode (``manual_synchronization=True``) a layer's copies are issued by its
      ``start_offload_layer`` and nothing more happens here.
    * ``offload_base_tensor=True``: each tensor that is a view (``t._base is not
      None``) is marked (attribute ``offload_base_tensor``, TransformerEngine's name),
      and when it is saved its copy covers its base's whole span, so the other views of
      the same base saved later (e.g. interleaved q, k, v) find their bytes already
      copied and cost no second copy. A view that spans at least half its storage is
      copied that way anyway.

    ``None`` entries are skipped; TE quantized tensors act through their data tensors.

    Args:
        tensors: the tensors (or ``None``).
        offload_base_tensor: copy the base of a view instead of the view. Default
            ``False``.

    Raises:
        TypeError: ``offload_base_tensor`` is not a bool, or an entry is not a tensor.

    Example:
        >>> qkv = torch.randn(8, 3 * 64)
        >>> q, k, v = qkv.chunk(3, dim=-1)
        >>> start_offload(q, k, v, offload_base_tensor=True)
    """
    if not isinstance(offload_base_tensor, bool):
        raise TypeError(
            f"offload_base_tensor must be a bool; got {type(offload_base_tensor).__name__} "
            f"{offload_base_tensor!r}"
        )
    flat: list[torch.Tensor] = []
    for t in tensors:
        if t is not None:
            flat.extend(_parts(t))
    if offload_base_tensor:
        for t in flat:
            if t._base is not None:
                t.offload_base_tensor = True
    owner = getattr(_active, "owner", None)
    step = None
    if isinstance(owner, ActivationOffloader):
        step = owner._step
    elif isinstance(owner, _ManualContext):
        step = owner.step
    if step is None or not flat:
        return
    plain = [t for t in flat if _packing.is_plain(t) and t.layout == torch.strided]
    if plain:
        step.flush_for(plain)


# --------------------------------------------------------------------------------------
# ActivationOffloader.attach


class AttachHandle:
    """What :meth:`ActivationOffloader.attach` returns: the two hooks on the model.

    ``remove()`` takes them off (idempotent); as a context manager, the block's end
    removes them. ``model`` is the attached module (``None`` once it was garbage
    collected), ``removed`` whether :meth:`remove` ran. Copies of the model
    (``copy.deepcopy``, pickling) are not attached: their copies of the hooks do nothing.
    """

    def __init__(self, offloader: ActivationOffloader, model: torch.nn.Module) -> None:
        import threading
        import weakref

        self._offloader = offloader
        self._model = weakref.ref(model)
        self.removed = False
        # Per thread: one frame per call of the model in flight, (entered, exception
        # being handled when the call started); the outermost call that found the
        # offloader free enters it, nested calls only push a frame.
        self._local = threading.local()
        self._hooks = [
            model.register_forward_pre_hook(_ModuleHook(self._forward_start), prepend=True),
            model.register_forward_hook(_ModuleHook(self._forward_end), always_call=True),
        ]
        offloader._hold_layer_hooks(True)

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model()

    def _frames(self) -> list[tuple[bool, BaseException | None]]:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def _forward_start(self, module: torch.nn.Module, args: Any) -> None:
        import sys

        frames = self._frames()
        off = self._offloader
        # sys.exc_info() here is an exception the *caller* is handling (a forward run
        # inside an `except` block); _forward_end must not take it for the forward's own
        frames.append((False, sys.exc_info()[1]))
        if off._step is None and torch.is_grad_enabled():
            off.__enter__()
            frames[-1] = (True, frames[-1][1])

    def _forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        import sys

        frames = self._frames()
        if not frames:  # a global pre-hook raised before ours ran
            return
        entered, outer = frames.pop()
        off = self._offloader
        if not entered or off._step is None:
            return
        exc_type, exc, tb = sys.exc_info()
        if exc is None or exc is outer:
            off.__exit__(None, None, None)
        else:  # called by always_call: the forward (or a hook before ours) raised
            off.__exit__(exc_type, exc, tb)

    def remove(self) -> None:
        """Remove the hooks from the model. Idempotent.

        Removing them while a forward they entered has not returned (from inside that
        forward, or after a ``KeyboardInterrupt``, which module hooks do not see) leaves
        the context as an exception would: what that forward offloaded is freed.
        """
        if self.removed:
            return
        self.removed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._offloader._hold_layer_hooks(False)
        attachments = self._offloader.__dict__.get("_attachments", [])
        attachments[:] = [r for r in attachments if r() is not None and r() is not self]
        frames = self._frames()
        entered = any(e for e, _ in frames)
        frames.clear()
        if entered and self._offloader._step is not None:
            error = RuntimeError(
                "offload: the attachment was removed while a forward it entered was running"
            )
            self._offloader.__exit__(RuntimeError, error, None)

    def __enter__(self) -> AttachHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        model = self.model
        name = "<collected>" if model is None else type(model).__name__
        state = "removed" if self.removed else "attached"
        return f"AttachHandle({name}, {state})"


class _ModuleHook:
    """One hook the offloader puts on a module (an attachment's, or a layer's). A copy
    of the module (``copy.deepcopy``: reference or EMA models; pickling) gets an inert
    hook instead of a copy of the offloader."""

    __slots__ = ("arity", "fn", "traced")

    def __init__(self, fn: Callable[..., None] | None, arity: int = 0) -> None:
        self.fn = fn
        #: the number of arguments torch passes this hook as registered (0: any). Torch
        #: registers a hook and marks it ``with_kwargs`` in two steps, and removes it in
        #: two: a forward running on another thread in between calls it with the other
        #: arity. That thread never owns the offloader (its owner registers and removes on
        #: its own thread), so such a call has nothing to do.
        self.arity = arity
        #: what a frame compiled by dynamo calls instead (``layer.compile()`` compiles
        #: the module's hooks with its forward): ``fn``, run eagerly, outside the graph
        self.traced = None if fn is None else _dynamo.eager(fn)

    def __call__(self, *args: Any) -> None:
        if self.fn is not None and (not self.arity or len(args) == self.arity):
            if torch.compiler.is_compiling():
                self.traced(*args)  # type: ignore[misc]
            else:
                self.fn(*args)  # without the eager wrapper's cost (about a microsecond)

    def __deepcopy__(self, memo: Any) -> _ModuleHook:
        return _ModuleHook(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ModuleHook, (None,))
