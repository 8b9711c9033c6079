"""Recomputed layer calls on a CUDA GPU (Note [recomputed calls]): calls past the host
budget run recomputed with their inputs offloaded, gradients bitwise equal to the same
model without offloading (deterministic algorithms), the step's activation peak far
below the same model's without offloading. Run on the GPU with
``PYTHONPATH=. python3 -m pytest -m cuda tests/activations/test_recompute_calls_cuda.py``."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same, twin

pytestmark = ON_CUDA_DETERMINISTIC

L = 8


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(models.LlamaBlock(256, 4, 1024) for _ in range(L)).to(
        "cuda", torch.bfloat16
    )


def _peak(layers, off, x) -> tuple[tuple, int]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = models.step(layers, x, models.run_plain, off)
    torch.cuda.synchronize()
    return got, torch.cuda.max_memory_allocated() - base


def test_calls_past_the_host_budget_run_recomputed_bitwise_and_free_the_device() -> None:
    layers = _layers()
    ref = twin(layers)
    x = torch.randn(2, 2048, 256, device="cuda", dtype=torch.bfloat16)
    probe = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    models.step(layers, x, models.run_plain, probe)
    per_call = max(la.bytes_offloaded for la in probe.stats.layers)
    probe.close()
    off = offload.ActivationOffloader(
        layers, offload_layers="all", min_tensor_bytes=0, host_memory_limit=int(2.5 * per_call)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            got, peak = _peak(layers, off, x)
            assert_same(got, models.step(ref, x, models.run_plain))
    recomputed = [la.index for la in off.stats.layers if la.recomputed]
    assert recomputed and recomputed[-1] == L - 2, recomputed
    assert off.stats.bytes_kept["host_limit"] == 0
    off.close()
    # the same budget with nothing recomputed keeps the overflow on the device
    _, plain_peak = _peak(ref, None, x)
    assert peak < plain_peak - (len(recomputed) - 1) * per_call // 2, (peak, plain_peak)
