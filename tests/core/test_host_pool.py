"""The host pool: best-fit sub-allocation, merging, budget, close (docs/design.md 4.2)."""

from __future__ import annotations

import random

import pytest
import torch

from offload._core import _host_pool
from offload._core._host_pool import ALIGN, MIN_SLAB_BYTES, HostPool


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


def test_typed_views_address_the_block_and_are_reused() -> None:
    pool = HostPool(limit=1 << 30, pin=False)
    a = pool.allocate(4 * 6)
    b = pool.allocate(4 * 6)
    va = a.typed(torch.float32, torch.Size([2, 3]), (3, 1))
    vb = b.typed(torch.float32, torch.Size([2, 3]), (3, 1))
    assert va.data_ptr() == a.slab.buffer.data_ptr() + a.start
    assert vb.data_ptr() == b.slab.buffer.data_ptr() + b.start
    vb.copy_(torch.arange(6.0).view(2, 3))
    assert torch.equal(b.tensor.view(torch.float32), torch.arange(6.0))
    start = b.start
    pool.free(b)
    again = pool.allocate(4 * 6)
    assert again.start == start  # best fit: the same place
    assert again.typed(torch.float32, torch.Size([2, 3]), (3, 1)) is vb  # cached
    other = again.typed(torch.float16, torch.Size([6]), (1,))  # another geometry
    assert other.dtype == torch.float16 and other.data_ptr() == vb.data_ptr()
    pool.free(a)
    pool.free(again)


def test_typed_view_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_host_pool, "MAX_CACHED_VIEWS", 4)
    pool = HostPool(limit=1 << 30, pin=False)
    block = pool.allocate(1024)
    for n in range(1, 11):
        view = block.typed(torch.uint8, torch.Size([n]), (1,))
        assert view.numel() == n and view.data_ptr() == block.tensor.data_ptr()
        assert len(block.slab.views) <= 4
    pool.free(block)


def test_extend_grows_in_place_only_into_free_bytes_and_trim_gives_back() -> None:
    pool = HostPool(limit=1 << 30, pin=False)
    a = pool.allocate(ALIGN)
    assert a is not None and a.nbytes == ALIGN
    start = a.start
    assert pool.extend(a, 4 * ALIGN + 1)  # the bytes after it are free
    assert a.start == start and a.nbytes == 5 * ALIGN and a.length == 4 * ALIGN + 1
    assert pool.in_use_bytes == 5 * ALIGN and pool.peak_bytes >= 5 * ALIGN
    b = pool.allocate(ALIGN)  # right after a
    assert b is not None and b.start == a.start + a.nbytes
    assert not pool.extend(a, 6 * ALIGN)  # b is in the way: refused, a unchanged
    assert a.nbytes == 5 * ALIGN
    pool.trim(a, ALIGN + 1)  # keeps two aligned units, gives back three
    assert a.nbytes == 2 * ALIGN and a.length == ALIGN + 1
    assert pool.in_use_bytes == 3 * ALIGN
    c = pool.allocate(3 * ALIGN)  # best fit: the trimmed tail
    assert c is not None and c.start == a.start + 2 * ALIGN
    for block in (a, b, c):
        pool.free(block)
    assert pool.in_use_bytes == 0
    for slab in pool._slabs:
        assert slab.starts == [0] and slab.sizes == [slab.size]


def _scan_best_fit(pool: HostPool, length: int) -> tuple[int, int] | None:
    """The best fit by a scan of every slab in creation order (the first smallest range
    that holds the request): ``(slab order, start)``, ``None`` when none holds it."""
    nbytes = (length + ALIGN - 1) & -ALIGN or ALIGN
    best = None
    for slab in pool._slabs:
        for start, size in zip(slab.starts, slab.sizes):
            if size >= nbytes and (best is None or size < best[0]):
                best = (size, slab.order, start)
    return None if best is None else best[1:]


def _check_index(pool: HostPool) -> None:
    want = sorted((z, s.order, a) for s in pool._slabs for a, z in zip(s.starts, s.sizes))
    assert pool._free == want
    for slab in pool._slabs:
        assert slab.starts == sorted(slab.starts)
        ends = [a + z for a, z in zip(slab.starts, slab.sizes)]
        assert all(e < a for e, a in zip(ends, slab.starts[1:]))  # merged, disjoint


def test_sorted_index_gives_the_best_fit_of_a_scan() -> None:
    # Random allocations, frees, extensions and trims across several slabs: every block
    # is the one a scan of every slab would choose, and the index always equals the
    # slabs' free ranges.
    rng = random.Random(0)
    pool = HostPool(limit=64 << 20, pin=False, min_slab=1 << 20)
    live: list = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.5 or not live:
            length = rng.choice([rng.randint(1, 4096), rng.randint(1, 300_000)])
            expected = _scan_best_fit(pool, length)
            block = pool.allocate(length)
            if block is None:
                continue
            if expected is not None:
                assert (block.slab.order, block.start) == expected
            else:
                assert block.start == 0 and block.slab is pool._slabs[-1]
            live.append(block)
        elif op < 0.8:
            pool.free(live.pop(rng.randrange(len(live))))
        elif op < 0.9:
            block = rng.choice(live)
            pool.extend(block, block.length + rng.randint(1, 8192))
        else:
            block = rng.choice(live)
            pool.trim(block, rng.randint(1, block.length))
        _check_index(pool)
        assert pool.in_use_bytes == sum(b.nbytes for b in live)
    for block in live:
        pool.free(block)
    _check_index(pool)
    assert pool.in_use_bytes == 0
    for slab in pool._slabs:
        assert slab.starts == [0] and slab.sizes == [slab.size]


def test_slabs_grow_with_the_pool_so_larger_tensors_fit_later() -> None:
    """Many tensors of one size, then one several times larger (a longer sequence):
    it fits in the slabs already reserved (module docstring of offload/_core/_host_pool.py),
    and the pool holds at most about a quarter more than it ever needed."""
    mib = 1 << 20
    pool = HostPool(limit=1 << 40, pin=False)
    blocks = [pool.allocate(40 * mib) for _ in range(40)]
    needed = pool.in_use_bytes
    assert pool.reserved_bytes <= 1.5 * needed + MIN_SLAB_BYTES
    sizes = sorted(s.size for s in pool._slabs)
    assert sizes[-1] >= 8 * MIN_SLAB_BYTES  # larger slabs as the pool grows
    for b in blocks:
        pool.free(b)
    reserved = pool.reserved_bytes
    big = pool.allocate(300 * mib)
    assert big is not None and pool.reserved_bytes == reserved  # no new slab
    pool.free(big)
    # the old rule (every slab sized by its first request) would have grown here
    flat = HostPool(limit=1 << 40, pin=False, ahead=False)
    for b in [flat.allocate(40 * mib) for _ in range(40)]:
        flat.free(b)
    reserved = flat.reserved_bytes
    flat.free(flat.allocate(300 * mib))
    assert flat.reserved_bytes > reserved
