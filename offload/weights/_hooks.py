"""Forward and backward hooks of offloaded layers and the completion of each layer's
backward: when a layer's weights are brought back, prefetched and freed (FSDP2's
``_fsdp_state``). Every hook is an eager boundary for ``torch.compile``."""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload._core import _packing
from offload._core._dynamo import eager
from offload._core._runtime import in_backward as _in_backward

if TYPE_CHECKING:
    from offload.weights._residency import _Layers, _WeightSlot
    from offload.weights._storage import _WeightParam

_tensors_in = _packing.tensors_requiring_grad

#: ``eager`` applied when a hook is first registered, once per function: at import it
#: would load dynamo (which probes for triton) with the package.
lazy_eager = functools.cache(eager)


class _LayerCall:
    """One call of a slot's module whose outputs require grad: its backward's state."""

    __slots__ = (
        "slot",
        "pos",
        "expected",
        "seen",
        "active",
        "ran",
        "dead",
        "handles",
        "__weakref__",
    )

    def __init__(self, slot: int, pos: int, expected: int) -> None:
        self.slot = slot
        self.pos = pos  # position in the call sequence (-1: called inside a backward)
        self.expected = expected  # inputs that require grad
        self.seen = 0
        self.active = False
        self.ran = False  # its backward started at least once
        self.dead = False  # its graph is gone
        self.handles: list[Any] = []


class _OutputHook:
    """The hook on a call's output gradient (its backward begins). Its death, with the
    graph that holds it, marks the call dead."""

    __slots__ = ("owner", "call", "inputs_of", "__weakref__")

    def __init__(self, owner: weakref.ref, call: _LayerCall) -> None:
        self.owner = owner
        self.call = call
        # Later calls that take this very tensor as input: its gradient completes that
        # input of theirs. Told first, so the layer after is freed before this one's
        # backward refills anything.
        self.inputs_of: list[_LayerCall] = []

    def __call__(self, _grad: Any) -> None:
        hooks = self.owner()
        if hooks is not None:
            for call in self.inputs_of:
                hooks.input_done(call)
            hooks.backward_start(self.call)


def _mark_dead(call: _LayerCall) -> None:
    call.dead = True


# The hooks are module-level functions holding a weak reference to the offloader's
# _Hooks, so that the model's hooks do not keep it alive (its close restores the
# parameters). Each is registered through lazy_eager.


def _forward_pre(ref: weakref.ref, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
    hooks = ref()
    if hooks is not None and not hooks.layers.closed:
        hooks.forward_start(hooks.layers.slots[index])


def _forward_post(
    ref: weakref.ref, index: int, module: nn.Module, args: Any, kwargs: Any, output: Any
) -> None:
    hooks = ref()
    if hooks is not None and not hooks.layers.closed:
        hooks.forward_end(hooks.layers.slots[index], args, kwargs, output)


def _input_grad(ref: weakref.ref, call: _LayerCall, _grad: Any) -> None:
    hooks = ref()
    if hooks is not None:
        hooks.input_done(call)


def _accumulated(ref: weakref.ref, index: int, prm: _WeightParam, param: torch.Tensor) -> None:
    hooks = ref()
    if hooks is not None:
        hooks.param_done(hooks.layers.slots[index], prm)


def _backward_end(ref: weakref.ref) -> None:
    hooks = ref()
    if hooks is not None:
        hooks.end_backward()


class _Hooks:
    """The hooks of one offloader's layers and the state of the forward and backward in
    flight (Note [weight residency]: which hold each hook takes or drops)."""

    def __init__(self, layers: _Layers) -> None:
        self.layers = layers
        self.ref = weakref.ref(self)
        self.ahead: list[_WeightSlot] = []  # the latest forward prefetch
        self.calls: list[_LayerCall] = []
        # id(output tensor) -> (weak reference to it, its _OutputHook): single-tensor
        # hooks, which later calls taking that tensor as input join
        self.out_hooks: dict[int, tuple[weakref.ref, _OutputHook]] = {}
        self.cb_queued = False
        self.bwd_running = False
        # backward prefetches waiting for the layer after theirs to be freed:
        # (slot whose backward started, its position, the layer after it)
        self.deferred: list[tuple[_WeightSlot, int, _WeightSlot]] = []

    # ---- registration -----------------------------------------------------------------

    def register(self, slot: _WeightSlot, module_hooks: bool) -> None:
        """The forward hooks (unless the module runs now: see ``register_forward``) and
        each trainable parameter's post-accumulate-grad hook."""
        if module_hooks:
            self.register_forward(slot)
        for prm in slot.params:
            if prm.param.requires_grad:
                hook = functools.partial(lazy_eager(_accumulated), self.ref, slot.sid, prm)
                slot.hooks.append(prm.param.register_post_accumulate_grad_hook(hook))

    def register_forward(self, slot: _WeightSlot) -> None:
        pre = functools.partial(lazy_eager(_forward_pre), self.ref, slot.sid)
        post = functools.partial(lazy_eager(_forward_post), self.ref, slot.sid)
        m = slot.module
        slot.hooks.append(m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
        slot.hooks.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))

    def remove_calls(self) -> None:
        for call in self.calls:
            for h in call.handles:
                h.remove()
        self.calls = []

    # ---- forward ----------------------------------------------------------------------

    def forward_start(self, slot: _WeightSlot) -> None:
        layers = self.layers
        in_backward = _in_backward()
        with layers.lock:
            pos = -1 if in_backward else self._advance(slot)
            if not in_backward:
                self._recover(prune=pos <= 0)  # pruning: once per forward
            stream = layers.backend.current_stream()  # type: ignore[union-attr]
            slot.frames.append((sys.exc_info()[1], pos))
            slot.want_fwd = False
            slot.fwd += 1
            if not slot.resident:
                layers.refills_on_demand += 1
            layers.make_resident(slot, stream)
            layers.wait_ready(slot, stream)
            n = layers.prefetch_layers
            if n and pos >= 0:
                ahead = [s for s in layers.sequence[pos + 1 : pos + 1 + n] if s is not slot]
                for s in self.ahead:  # prefetched for calls that did not come
                    if s.want_fwd and s is not slot and all(s is not t for t in ahead):
                        s.want_fwd = False
                        layers.maybe_free(s)
                self.ahead = ahead
                layers.prefetch(ahead, stream, False)
            if layers.grads == "host":
                layers.host_grads.set_staging(slot, allocate=False)  # type: ignore[union-attr]

    def _advance(self, slot: _WeightSlot) -> int:
        """The position of this call in the call sequence: the next occurrence of the
        slot after the previous call, else its first one (a new forward)."""
        layers = self.layers
        seq, nxt = layers.sequence, layers.cursor + 1
        if nxt < len(seq) and seq[nxt] is slot:  # the usual case: the next call in order
            layers.cursor = nxt
            return nxt
        for p in itertools.chain(range(nxt, len(seq)), range(min(nxt, len(seq)))):
            if seq[p] is slot:
                layers.cursor = p
                return p
        return -1

    def forward_end(self, slot: _WeightSlot, args: Any, kwargs: Any, output: Any) -> None:
        layers = self.layers
        before, pos = slot.frames.pop() if slot.frames else (None, -1)
        exc = sys.exc_info()[1]
        failed = exc is not None and exc is not before
        in_backward = _in_backward()
        register = not failed and torch.is_grad_enabled()
        outputs = _tensors_in(output, []) if register else []
        with layers.lock:
            slot.fwd = max(0, slot.fwd - 1)
            if failed and not in_backward:
                for s in layers.order:  # forward prefetches that will not be used
                    if s.want_fwd:
                        s.want_fwd = False
                        layers.maybe_free(s)
            if outputs and pos >= 0 and pos >= len(layers.sequence) - layers.prefetch_layers:
                slot.want_bwd = True  # its backward comes right after the forward
            if layers.grads == "host" and not slot.bwd_active:
                layers.host_grads.unset_staging(slot)  # type: ignore[union-attr]
            layers.maybe_free(slot)
        if outputs:
            self._register_backward(slot, pos, args, kwargs, outputs)

    def _register_backward(
        self, slot: _WeightSlot, pos: int, args: Any, kwargs: Any, outputs: list
    ) -> None:
        inputs = _tensors_in((args, kwargs), [])
        call = _LayerCall(slot.sid, pos, len(inputs))
        hook = _OutputHook(self.ref, call)
        hook_fn = functools.partial(lazy_eager(_OutputHook.__call__), hook)
        for t in inputs:
            entry = self.out_hooks.get(id(t))
            if entry is not None and entry[0]() is t:  # the output of an earlier call
                entry[1].inputs_of.append(call)
            else:
                call.handles.append(
                    t.register_hook(functools.partial(lazy_eager(_input_grad), self.ref, call))
                )
        # An in-place op on an output that is a view (x += r on a reshaped GEMM result,
        # inside the layer or after it) rebases the view's history: the node a hook on
        # the view sits on leaves the graph, but the base's earlier node stays. So the
        # bases of view outputs are watched too; the first gradient to arrive triggers.
        targets: dict[int, torch.Tensor] = {}
        for t in outputs:
            targets[id(t)] = t
            base = t._base
            if base is not None and base.requires_grad:
                targets[id(base)] = base
        if len(targets) == 1:
            outputs[0].register_hook(hook_fn)
            self.out_hooks[id(outputs[0])] = (weakref.ref(outputs[0]), hook)
        else:
            torch.autograd.graph.register_multi_grad_hook(
                list(targets.values()), hook_fn, mode="any"
            )
        weakref.finalize(hook, _mark_dead, call)
        with self.layers.lock:
            self.calls.append(call)

    # ---- backward ---------------------------------------------------------------------

    def _queue_end(self) -> None:
        if self.cb_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(lazy_eager(_backward_end), self.ref)
            )
            self.cb_queued = True
        except RuntimeError:  # not inside a backward: nothing to end
            pass

    def backward_start(self, call: _LayerCall) -> None:
        layers = self.layers
        with layers.lock:
            if layers.closed or call.active:
                return
            slot = layers.slots[call.slot]
            self._queue_end()
            self.bwd_running = True
            call.active = True
            call.ran = True
            call.seen = 0
            if not slot.bwd_active:
                slot.bwd_active = True
                slot.bwd_inputs = False
                slot.seen.clear()
            if call.expected:
                slot.bwd += 1
                slot.bwd_inputs = True
            slot.want_bwd = False
            stream = layers.backend.current_stream()  # type: ignore[union-attr]
            if not slot.resident:
                layers.refills_on_demand += 1
            layers.make_resident(slot, stream)
            layers.wait_ready(slot, stream)
            if layers.grads == "host":
                layers.host_grads.set_staging(slot, allocate=True)  # type: ignore[union-attr]
            if layers.prefetch_layers and call.pos > 0:
                # The layer after this one usually ends its backward a moment later (the
                # gradient that starts this layer completes that one's inputs): prefetch
                # once it is freed, so at most prefetch_layers + 1 layers are resident.
                pos = call.pos
                seq = layers.sequence
                after = seq[pos + 1] if pos + 1 < len(seq) else None
                if after is not None and after is not slot and after.bwd_active:
                    self.deferred.append((slot, pos, after))
                else:
                    self._prefetch_behind(slot, call.pos, stream)
            if not call.expected:
                call.active = False
            self._check_done(slot)

    def _prefetch_behind(self, slot: _WeightSlot, pos: int, stream: Any) -> None:
        layers = self.layers
        behind = layers.sequence[max(0, pos - layers.prefetch_layers) : pos]
        layers.prefetch([s for s in reversed(behind) if s is not slot], stream, True)

    def input_done(self, call: _LayerCall) -> None:
        layers = self.layers
        with layers.lock:
            if layers.closed or not call.active:
                return
            call.seen += 1
            if call.seen >= call.expected:
                call.active = False
                slot = layers.slots[call.slot]
                slot.bwd = max(0, slot.bwd - 1)
                self._check_done(slot)

    def param_done(self, slot: _WeightSlot, prm: _WeightParam) -> None:
        layers = self.layers
        with layers.lock:
            if layers.closed:
                return
            if layers.grads == "host":
                layers.host_grads.grad_to_host(slot, prm)  # type: ignore[union-attr]
            p = prm.param
            if slot.bwd_active and id(p) in slot.expected:
                slot.seen.add(id(p))
                self._check_done(slot)

    def _check_done(self, slot: _WeightSlot) -> None:
        """The slot's backward is over when its calls' input gradients are complete and
        every parameter that gets a ``.grad`` has accumulated it."""
        if not slot.bwd_active or slot.bwd > 0:
            return
        if slot.expected:
            if not slot.expected <= slot.seen:
                return
        elif not slot.bwd_inputs:
            return  # nothing tells when: the end of the backward frees it
        layers = self.layers
        slot.bwd_active = False
        layers.host_grads.flush_staging(slot)  # type: ignore[union-attr]
        layers.host_grads.release_pending(keep=slot.sid)  # type: ignore[union-attr]
        layers.maybe_free(slot)
        if self.deferred:
            stream = layers.backend.current_stream()  # type: ignore[union-attr]
            rest = []
            for waiting, pos, blocker in self.deferred:
                if blocker.bwd_active:
                    rest.append((waiting, pos, blocker))
                elif waiting.bwd_active:  # still needs the layers before it
                    self._prefetch_behind(waiting, pos, stream)
            self.deferred = rest

    def end_backward(self) -> None:
        """Queued on autograd's engine at the first hook of a backward: runs when it ends."""
        with self.layers.lock:
            self.cb_queued = False
            self._cleanup_backward()
        self.layers.host_grads.drain()  # type: ignore[union-attr]

    def _cleanup_backward(self) -> None:
        """Free what the last backward left (lock held)."""
        layers = self.layers
        self.bwd_running = False
        self.deferred = []
        self.out_hooks = {k: v for k, v in self.out_hooks.items() if v[0]() is not None}
        for slot in layers.slots:
            if slot.bwd_active or slot.bwd:
                layers.host_grads.flush_staging(slot)  # type: ignore[union-attr]
            slot.bwd = 0
            slot.bwd_active = False
            slot.want_bwd = False
            slot.want_fwd = False
        keep = []
        for call in self.calls:
            if call.ran or call.dead:
                call.active = False
                for h in call.handles:
                    h.remove()
                call.handles.clear()
            else:
                keep.append(call)
        self.calls = keep
        layers.host_grads.release_pending()  # type: ignore[union-attr]
        for slot in layers.slots:
            layers.maybe_free(slot)

    def _recover(self, prune: bool) -> None:
        """At a forward outside any backward (lock held): a backward that raised never
        ran its end callback, so clean up after it; with ``prune`` (the first layer of a
        forward) also drop the hooks of calls whose graph died without a backward."""
        if self.bwd_running:
            self.cb_queued = False
            self._cleanup_backward()
            self.layers.host_grads.drain()  # type: ignore[union-attr]
        if not prune:
            return
        self.out_hooks = {k: v for k, v in self.out_hooks.items() if v[0]() is not None}
        if any(c.dead for c in self.calls):
            keep = []
            for call in self.calls:
                if call.dead:
                    for h in call.handles:
                        h.remove()
                else:
                    keep.append(call)
            self.calls = keep
