"""The levers a plan assigns to layers, and the recompute levers' wrapped forward.

``keep`` and ``offload`` need nothing here (the offloader does the offloading); the five
recompute levers wrap the layer's forward (:class:`Recompute`): the full ones in
``torch.utils.checkpoint`` or :func:`offload._recompute._reentrant.recompute` (the plan's
``recompute``), the selective ones in ``torch.utils.checkpoint`` through a pair of
dispatch modes that keep the outputs of matrix products and attention
(:class:`KeepOutputs`, :class:`RecomputeFromKept`) and learn which of them no recompute
uses (:class:`KeptKeys`).
A recompute lever whose layer the offloader handles sends what the checkpoint saves
through the saved-tensor hooks (the layer's inputs), and under ``selective_offload`` the
kept outputs too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload._core._kept import Kept, Raw, unpack_hook
from offload._recompute._reentrant import check_recompute, recompute
from offload.activations._control import current_pack

__all__ = [
    "DEFAULT_LEVERS",
    "LEVERS",
    "NOT_LAST",
    "OFFLOADED",
    "RECOMPUTED",
    "RECOMPUTE_KIND",
    "SHORT",
    "CompressedLayers",
    "KeptKeys",
    "KeepOutputs",
    "Recompute",
    "RecomputeFromKept",
    "check_levers",
    "summary",
]

#: The levers (the search assigns them to layers in the order offload,
#: selective_offload, checkpoint or checkpoint_offload, selective or
#: selective_offload_inputs, keep).
LEVERS = (
    "keep",
    "offload",
    "selective",
    "checkpoint",
    "selective_offload",
    "checkpoint_offload",
    "selective_offload_inputs",
)

#: The levers :func:`offload.plan` may use unless told otherwise: every lever. Pass a
#: subset to forbid some.
DEFAULT_LEVERS = LEVERS

#: The levers whose layers the offloader handles (in its ``offload_layers``).
OFFLOADED = ("offload", "selective_offload", "checkpoint_offload", "selective_offload_inputs")

#: The offloaded levers the last layer cannot take: they send most of what it saves,
#: and nothing after it hides that copy (the head waits for it, and the last layer's
#: backward for its reload, which starts with that backward). The levers that send only
#: the layer's inputs (a few MiB: ``checkpoint_offload``, ``selective_offload_inputs``)
#: may take it: its inputs then leave the device before the head and the loss, which
#: often hold the step's peak.
NOT_LAST = ("offload", "selective_offload")

#: The levers that recompute the layer's forward in the backward (:class:`Recompute`).
RECOMPUTED = (
    "selective",
    "checkpoint",
    "selective_offload",
    "checkpoint_offload",
    "selective_offload_inputs",
)

#: The recompute of each recompute lever: what :func:`offload.plan` measures on every
#: layer to fit the lever's kept fraction and extra time.
RECOMPUTE_KIND = {
    "selective": "selective",
    "selective_offload": "selective",
    "selective_offload_inputs": "selective",
    "checkpoint": "checkpoint",
    "checkpoint_offload": "checkpoint",
}

#: Short names of the levers (tables, error messages).
SHORT = {
    "keep": "keep",
    "offload": "offload",
    "selective": "sel",
    "checkpoint": "ckpt",
    "selective_offload": "sel+off",
    "checkpoint_offload": "ckpt+off",
    "selective_offload_inputs": "sel+in",
}


def check_levers(levers: Sequence[str], name: str) -> tuple[str, ...]:
    """``levers`` as a tuple of lever names; ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(levers, str) or not isinstance(levers, Sequence):
        raise TypeError(f"{name} must be a sequence of lever names; got {levers!r}")
    bad = [x for x in levers if x not in LEVERS]
    if bad:
        raise ValueError(f"{name}: unknown lever(s) {bad}; accepted: {', '.join(LEVERS)}")
    return tuple(levers)


def summary(levers: Sequence[str]) -> str:
    """``"3 offload, 2 checkpoint, 3 keep"``: the count of each lever used."""
    counts = {name: sum(1 for x in levers if x == name) for name in LEVERS}
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n)


# --------------------------------------------------------------------------------------
# recompute levers: a wrapped forward per layer


def _save_ops() -> frozenset[Any]:
    """The aten ops whose outputs selective recompute keeps: matrix products and
    attention (everything else is recomputed)."""
    aten = torch.ops.aten
    names = [
        ("mm", "default"),
        ("addmm", "default"),
        ("bmm", "default"),
        ("baddbmm", "default"),
        ("_scaled_mm", "default"),
        ("convolution", "default"),
        ("_scaled_dot_product_flash_attention", "default"),
        ("_scaled_dot_product_efficient_attention", "default"),
        ("_scaled_dot_product_cudnn_attention", "default"),
        ("_scaled_dot_product_flash_attention_for_cpu", "default"),
        ("_flash_attention_forward", "default"),
        ("_efficient_attention_forward", "default"),
    ]
    ops = []
    for name, overload in names:
        packet = getattr(aten, name, None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is not None:
            ops.append(op)
    return frozenset(ops)


_SAVE = _save_ops()


class KeptKeys:
    """What the selective levers of one layer keep, and what they have learnt not to.

    A selective layer keeps the outputs of the ops of :func:`_save_ops` (matrix
    products, attention) at forward, keyed ``(op, n)`` for the ``n``-th call of ``op``
    in the layer's forward, and its recompute returns them instead of running those
    ops again. The recompute stops after the last tensor the layer's backward needs
    (non-reentrant checkpoint's early stop), so an output made after that point (in a
    transformer block: the MLP's down projection, whose only consumer is the residual
    add) is never asked for. Each recompute that ends reports the keys it did not use;
    keys no recompute has used are not kept from the next forward on. The first step
    of a layer keeps them all (it is the one that learns).

    Invariant: skipping a key changes memory and time, never results. A skipped op that
    a later recompute does reach (other inputs, other control flow) simply runs again,
    as under full checkpointing; its key is kept again from then on.
    """

    __slots__ = ("unused", "used")

    def __init__(self) -> None:
        self.unused: frozenset[tuple[Any, int]] = frozenset()
        self.used: set[tuple[Any, int]] = set()

    def learn(self, left: set[tuple[Any, int]], consumed: set[tuple[Any, int]]) -> None:
        """One recompute ended: it reached the keys ``consumed`` and left the stored
        keys ``left`` untouched."""
        self.used |= consumed
        self.unused = frozenset((self.unused | left) - self.used)


def call_key(calls: dict[Any, int], func: Any) -> tuple[Any, int]:
    """``(func, n)`` for the ``n``-th call of ``func`` counted in ``calls``: the key both
    halves of the selective levers give the same call (forward and recompute run the
    same ops in the same order)."""
    n = calls.get(func, 0)
    calls[func] = n + 1
    return (func, n)


class KeepOutputs(TorchDispatchMode):
    """The forward half of the selective levers: runs every op and hands each tensor
    output of the kept ops (:func:`_save_ops`, less the keys ``kept`` learnt are never
    used) to ``pack`` (``offload._core._kept.Kept``: stays on the device; or the offloader's
    ``Step.pack``: a copy to the host, released on its schedule), into ``storage``."""

    def __init__(
        self, pack: Callable[[torch.Tensor], Any], storage: dict[Any, Any], kept: KeptKeys
    ) -> None:
        super().__init__()
        self.pack = pack
        self.storage = storage
        self.kept = kept
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SAVE:
            key = call_key(self.calls, func)
            if key not in self.kept.unused:
                if isinstance(out, torch.Tensor):
                    entry: Any = self.pack(out)
                else:
                    entry = tuple(
                        self.pack(t) if isinstance(t, torch.Tensor) else Raw(t) for t in out
                    )
                self.storage[key] = entry
        return out


class RecomputeFromKept(TorchDispatchMode):
    """The recompute half of the selective levers: a kept op returns what
    :class:`KeepOutputs` stored for the same call (``unpack_hook``: checked for
    in-place changes, reloaded by the offloader) instead of running again; every other
    op runs. When the recompute ends it tells ``kept`` which stored keys it used."""

    def __init__(self, storage: dict[Any, Any], kept: KeptKeys) -> None:
        super().__init__()
        self.storage = storage
        self.kept = kept
        self.calls: dict[Any, int] = {}
        self.consumed: set[tuple[Any, int]] = set()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:  # what is still stored was never asked for
            self.kept.learn(set(self.storage), self.consumed)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _SAVE:
            key = call_key(self.calls, func)
            self.consumed.add(key)  # reached: kept from now on, even if skipped so far
            entry = self.storage.pop(key, None)
            if entry is not None:
                if isinstance(entry, tuple):
                    return tuple(unpack_hook(e) for e in entry)
                return unpack_hook(entry)
        return func(*args, **(kwargs or {}))


class Recompute:
    """A layer's forward with its intermediate tensors recomputed in the backward: full
    (``checkpoint``; ``checkpoint_offload`` is the same wrapper on a layer the offloader
    handles, so the inputs the recompute saves travel) by torch's non-reentrant
    checkpoint or, with ``recompute="reentrant"``, by the reentrant scheme (Note [full
    recompute] in ``recompute.py``); or selective under torch's non-reentrant checkpoint
    (``selective``: the kept outputs stay on the device; ``selective_offload_inputs``:
    the same on a layer the offloader handles, so only its inputs travel;
    ``selective_offload``: the kept outputs go to ``offloader`` too, entered around the
    forward) through
    :class:`KeepOutputs` and :class:`RecomputeFromKept`; installed as the module's
    instance attribute ``forward`` and removed by :meth:`remove` (which restores what
    was there before)."""

    def __init__(
        self,
        module: torch.nn.Module,
        lever: str,
        offloader: Any = None,
        kept: KeptKeys | None = None,
        recompute: str = "non_reentrant",
    ) -> None:
        self.module = module
        self.lever = lever
        self.recompute = check_recompute(recompute)
        self.offloader = offloader
        self.kept = kept if kept is not None else KeptKeys()
        self.had_attr = "forward" in module.__dict__
        self.previous = module.__dict__.get("forward")
        self.inner = module.forward
        self.name = type(module).__name__
        module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        if RECOMPUTE_KIND[self.lever] == "selective":
            return checkpoint(
                self.inner, *args, use_reentrant=False, context_fn=self._selective_context, **kwargs
            )
        if self.recompute == "reentrant":
            return recompute(self.inner, self.name, *args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    def _selective_context(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        """``context_fn`` of the selective levers: a fresh storage per layer call. The
        kept outputs go to the offloader's current step under ``selective_offload``
        inside its context; otherwise (``selective``, ``selective_offload_inputs``) they
        stay on the device (``offload._core._kept.Kept``)."""
        pack = None
        if self.lever == "selective_offload" and self.offloader is not None:
            pack = current_pack(self.offloader)
        if pack is None:
            pack = Kept
        storage: dict[Any, Any] = {}
        return KeepOutputs(pack, storage, self.kept), RecomputeFromKept(storage, self.kept)

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            if self.had_attr:
                self.module.forward = self.previous
            else:
                del self.module.forward


class CompressedLayers:
    """The ``compress_filter`` of a plan that compresses only some of its offloaded
    layers: ``True`` for a 16-bit float tensor saved while one of ``compressed`` (layer
    indices) runs its forward, as the offloader's default filter says for every layer.

    The layer running is the one whose forward started last (a forward pre-hook per
    layer, removed by :meth:`remove`): the offloader places a layer's saves while it
    runs, and the first layer's when it ends, before the next one starts.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], compressed: Sequence[int]) -> None:
        self.compressed = frozenset(compressed)
        self.current = -1
        self.hooks = [
            layer.register_forward_pre_hook(lambda *_, i=i: self._start(i))
            for i, layer in enumerate(layers)
        ]

    def _start(self, index: int) -> None:
        self.current = index

    def __call__(self, t: torch.Tensor) -> bool:
        return self.current in self.compressed and t.dtype in (torch.bfloat16, torch.float16)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
