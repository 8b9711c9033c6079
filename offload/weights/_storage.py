"""Per-parameter storage of an offloaded layer: the parameters' own device storage, resized
in place, its host copy in a pinned slab, and the copies between the two (FSDP2's
``_fsdp_param``). Note [weight residency] says when each copy runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload._core._host_pool import HostBlock, HostPool

if TYPE_CHECKING:
    from offload._core._device import Backend
    from offload.weights._init import _InspectedLayer


class _WeightStore:
    """One device storage of a layer's parameters and its host copy."""

    __slots__ = ("storage", "nbytes", "device", "block", "host")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int, dev: torch.device) -> None:
        self.storage = storage  # the parameters' own storage, resized in place
        self.nbytes = nbytes
        # A byte tensor over the storage with a version counter of its own: refills
        # write through it, so the parameters' versions do not move.
        self.device = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
        self.block: HostBlock | None = None
        self.host: torch.Tensor | None = None  # uint8 host bytes (block.tensor)


class _WeightParam:
    """One parameter of a layer: its store, and with grads="host" its master and grads."""

    __slots__ = ("param", "names", "store", "fused", "master", "main_grad", "staging", "live")

    def __init__(self, param: nn.Parameter, name: str, store: _WeightStore, fused: bool) -> None:
        self.param = param
        self.names = [name]  # every name under the layer's module (tied inside the layer)
        self.store = store
        self.fused = fused
        self.master: torch.Tensor | None = None  # fp32 host copy the optimizer updates
        self.main_grad: torch.Tensor | None = None  # fp32 host gradient
        self.staging: torch.Tensor | None = None  # fused + host: device dW buffer
        self.live = False  # the staging buffer holds memory now


def host_view(prm: _WeightParam) -> torch.Tensor:
    """The parameter's elements in its host copy (same dtype, shape, strides)."""
    p = prm.param
    base = prm.store.host.view(p.dtype)  # type: ignore[union-attr]
    return base.as_strided(p.size(), p.stride(), base.storage_offset() + p.storage_offset())


def allocate_blocks(
    pool: HostPool, found: list[_InspectedLayer], pin_memory: bool
) -> dict[int, HostBlock]:
    """One host block per storage of ``found`` (storage key -> block); all or none."""
    # Largest storages first: best-fit then packs the slabs more tightly.
    todo = sorted(
        ((n, key) for layer in found for key, (_st, n, _p) in layer.stores.items()),
        reverse=True,
    )
    blocks: dict[int, HostBlock] = {}
    for nbytes, key in todo:
        block = pool.allocate(nbytes)
        if block is None:
            for b in blocks.values():
                pool.free(b)
            raise RuntimeError(
                f"offload: could not get {nbytes} bytes of "
                f"{'pinned ' if pin_memory else ''}host memory for a weight "
                f"({pool.reserved_bytes} bytes reserved so far); free host memory "
                f"or offload fewer layers"
            )
        blocks[key] = block
    return blocks


def copy_to_host(
    layer: _InspectedLayer, blocks: dict[int, HostBlock]
) -> tuple[list[_WeightStore], list[_WeightParam]]:
    """A layer's stores, each copied now into its host block, and its parameters."""
    stores: list[_WeightStore] = []
    params: list[_WeightParam] = []
    by_param: dict[int, _WeightParam] = {}
    for key, (storage, nbytes, named) in layer.stores.items():
        st = _WeightStore(storage, nbytes, layer.device)
        st.block = blocks[key]
        st.host = st.block.tensor
        st.host.copy_(st.device)  # synchronous: the weights are on the host after it
        stores.append(st)
        for name, p in named:
            prm = _WeightParam(p, name, st, id(p) in layer.fused)
            by_param[id(p)] = prm
            params.append(prm)
    for name, p in layer.named:  # a parameter registered under several names
        found = by_param.get(id(p))
        if found is not None and name not in found.names:
            found.names.append(name)
    return stores, params


def copy_in(backend: Backend, stores: list[_WeightStore], waits: list, stream: Any) -> Any:
    """Host copies into the device storages on the H2D stream, after ``waits`` and the
    work queued on ``stream``; returns the ready event (``None``: done already)."""
    pairs = [(st.host, st.device, None) for st in stores]
    return backend.h2d(pairs, waits, stream)


def write_back(backend: Backend, stores: list[_WeightStore]) -> Any:
    """Device storages into their host copies on the D2H stream; returns its event."""
    for st in stores:
        backend.d2h([(st.device, st.host, None)], None)
    return backend.record_d2h()


def free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)
