"""Fixtures shared by the test files."""

from __future__ import annotations

import os
from collections.abc import Iterator

# deterministic cuBLAS needs this workspace setting before cuBLAS starts: pytest imports
# this file before any test file
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch


@pytest.fixture
def cuda_deterministic() -> Iterator[None]:
    """Deterministic algorithms for one GPU test (bitwise comparisons against a run
    without offloading need them: cuBLAS and attention kernels may otherwise reduce in
    another order from run to run), switched off and the device synchronised after it.

    GPU test files use it for every test with
    ``pytestmark = tests.models.ON_CUDA_DETERMINISTIC``."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.cuda.synchronize()


@pytest.fixture
def applied_levers(monkeypatch) -> list[list[str]]:
    """The levers of every ``Plan`` applied during the test, in order (``Plan.apply``
    records them, then applies as usual)."""
    from offload._planner.plan import Plan

    applied: list[list[str]] = []
    apply = Plan.apply

    def recording_apply(self, model=None):
        applied.append(list(self.levers))
        return apply(self, model)

    monkeypatch.setattr(Plan, "apply", recording_apply)
    return applied
