"""Activation offloading under FSDP2 and tensor parallelism, on CPU with gloo
(2 processes spawned by the test). docs/design.md 4.7 (FSDP2's unsharded parameters never
travel) and 4.8 (DTensor activations are flattened and rebuilt)."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import offload
from tests import models

pytestmark = pytest.mark.distributed
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


class Stack(nn.Module):
    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(models.LlamaBlock(dim, 4, 2 * dim) for _ in range(n))

    def forward(self, x):
        return models.run_plain(self.layers, x)


def _fsdp_worker(rank: int, port: int, results: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    _init(rank, port)
    try:
        torch.manual_seed(0)
        model = Stack(4, 64)
        ref = copy.deepcopy(model)
        for m in (model, ref):
            for layer in m.layers:
                fully_shard(layer)
            fully_shard(m)
        off = offload.ActivationOffloader(model.layers, offload_layers="all", min_tensor_bytes=1024)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
        for step in range(3):
            x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(10 * step + rank))
            for m, opt, o in ((model, opts[0], off), (ref, opts[1], None)):
                with o if o is not None else models.contextlib.nullcontext():
                    loss = m(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            stats = off.stats
            assert all(la.bytes_offloaded > 0 for la in stats.layers[:3]), stats
        same = all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(model.parameters(), ref.parameters())
        )
        results[rank] = {
            "same": same,
            "per_layer": [la.bytes_offloaded for la in off.stats.layers],
            "parameter": off.stats.bytes_kept["parameter"],
        }
    finally:
        dist.destroy_process_group()


def _tp_worker(rank: int, port: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from offload._core import _packing

    _init(rank, port)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(64, 256)
                self.down = nn.Linear(256, 64)

            def forward(self, x):
                h = self.up(x)  # a DTensor sharded on the last dim
                return x + self.down(torch.tanh(h) * h)  # tanh, mul save DTensors

        torch.manual_seed(0)
        layers = nn.ModuleList(MLP() for _ in range(3))
        for layer in layers:
            parallelize_module(
                layer,
                mesh,
                {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()},
            )
        ref = copy.deepcopy(layers)
        seen = []
        original = _packing.flatten

        def spy(t):
            seen.append(type(t))
            return original(t)

        _packing.flatten = spy
        try:
            off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=1024)
            x = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(1))
            got = models.step(layers, x, models.run_plain, off)
        finally:
            _packing.flatten = original
        want = models.step(ref, x, models.run_plain)

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        same = torch.equal(got[0], want[0]) and all(
            torch.equal(local(a), local(b)) for a, b in zip(got[1], want[1])
        )
        results[rank] = {
            "same": same,
            "dtensors_flattened": sum(1 for c in seen if issubclass(c, DTensor)),
            "offloaded": [la.bytes_offloaded for la in off.stats.layers],
        }
    finally:
        dist.destroy_process_group()


def _spawn(worker) -> dict:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    return dict(results)


def test_fsdp2_offloading_gives_equal_parameters() -> None:
    results = _spawn(_fsdp_worker)
    assert set(results) == {0, 1}
    for r in results.values():
        assert r["same"]
        assert r["parameter"] > 0  # FSDP2's unsharded weights reached the hooks, were kept
    # Without parameters travelling, a layer sends exactly what it sends without FSDP.
    torch.manual_seed(0)
    plain = Stack(4, 64)
    off = offload.ActivationOffloader(plain.layers, offload_layers="all", min_tensor_bytes=1024)
    with off:
        plain(torch.randn(2, 32, 64)).square().mean()
    expected = [la.bytes_offloaded for la in off.stats.layers]
    for r in results.values():
        assert r["per_layer"] == expected


def test_tensor_parallel_dtensor_activations_round_trip() -> None:
    results = _spawn(_tp_worker)
    assert set(results) == {0, 1}
    for r in results.values():
        assert r["same"]
        assert r["dtensors_flattened"] > 0
        assert all(b > 0 for b in r["offloaded"][:2])
