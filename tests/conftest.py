"""Fixtures shared by the test files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def cuda_deterministic() -> Iterator[None]:
    """Deterministic algorithms for one GPU test (bitwise comparisons against a run
    without offloading need them: cuBLAS and attention kernels may otherwise reduce in
    another order from run to run), switched off and the device synchronised after it.

    GPU test files use it for every test with
    ``pytestmark = [..., pytest.mark.usefixtures("cuda_deterministic")]``."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.cuda.synchronize()
