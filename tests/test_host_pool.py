"""The host pool: best-fit sub-allocation, merging, budget, close (docs/design.md 4.2)."""

from __future__ import annotations

import random

import torch

from offload._host_pool import ALIGN, MIN_SLAB_BYTES, HostPool


def test_blocks_are_aligned_disjoint_and_merge_back() -> None:
    pool = HostPool(limit=1 << 30, pin=False)
    rng = random.Random(0)
    blocks = [pool.allocate(rng.randint(1, 1 << 20)) for _ in range(50)]
    assert all(b is not None for b in blocks)
    spans = sorted((id(b.slab), b.start, b.start + b.nbytes) for b in blocks)
    for (s1, _a1, e1), (s2, a2, _) in zip(spans, spans[1:]):
        assert s1 != s2 or e1 <= a2
    assert all(b.start % ALIGN == 0 for b in blocks)
    for b in blocks:  # bytes are really separate
        b.tensor.fill_(7)
    rng.shuffle(blocks)
    for b in blocks:
        pool.free(b)
    assert pool.in_use_bytes == 0
    for slab in pool._slabs:
        assert slab.starts == [0] and slab.sizes == [slab.size]


def test_slabs_are_powers_of_two_and_reused() -> None:
    pool = HostPool(limit=1 << 32, pin=False)
    big = pool.allocate(MIN_SLAB_BYTES + 1)
    assert pool.reserved_bytes == 2 * MIN_SLAB_BYTES
    pool.free(big)
    again = pool.allocate(MIN_SLAB_BYTES)
    assert pool.reserved_bytes == 2 * MIN_SLAB_BYTES  # reused, no new slab
    pool.free(again)


def test_budget_refuses_and_trims_empty_slabs() -> None:
    pool = HostPool(limit=3 * (1 << 20), pin=False)
    a = pool.allocate(1 << 20)
    assert a is not None and pool.reserved_bytes == 1 << 20
    assert pool.allocate(4 << 20) is None  # larger than the budget
    pool.free(a)
    b = pool.allocate(2 << 20)  # the empty 1 MiB slab is returned to make room
    assert b is not None and pool.reserved_bytes == 2 << 20
    assert pool.reserved_bytes <= pool.limit


def test_close_drops_slabs() -> None:
    pool = HostPool(limit=None, pin=False)
    assert pool.limit > 0
    b = pool.allocate(1000)
    b.tensor.copy_(torch.arange(1000, dtype=torch.uint8))
    pool.close()
    assert pool.reserved_bytes == 0
    assert b.tensor[999] == 999 % 256  # a block still handed out stays valid
    pool.free(b)
    assert pool.in_use_bytes == 0
