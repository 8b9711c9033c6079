"""Argument checking: TypeError for wrong types, ValueError for bad values, each naming
the argument; and importing the package touches no CUDA state."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from torch import nn

import offload


def layers(n: int = 3) -> list[nn.Module]:
    return [nn.Linear(4, 4) for _ in range(n)]


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"offload_layers": "some"}, ValueError, "accepted strings"),
        ({"max_slowdown": "3%"}, TypeError, "max_slowdown"),
        ({"max_slowdown": -0.1}, ValueError, "max_slowdown"),
        ({"offload_layers": True}, TypeError, "offload_layers"),
        ({"offload_layers": -1}, ValueError, "offload_layers"),
        ({"offload_layers": 4}, ValueError, "offload_layers=4"),
        ({"offload_layers": [0, 3]}, ValueError, "[3]"),
        ({"offload_layers": [0, 0]}, ValueError, "repeats"),
        ({"offload_layers": [0, 1.0]}, TypeError, "offload_layers"),
        ({"min_tensor_bytes": -1}, ValueError, "min_tensor_bytes"),
        ({"min_tensor_bytes": 1.5}, TypeError, "min_tensor_bytes"),
        ({"prefetch_layers": 0}, ValueError, "prefetch_layers"),
        ({"prefetch_layers": "1"}, TypeError, "prefetch_layers"),
        ({"pin_memory": 1}, TypeError, "pin_memory"),
        ({"host_memory_limit": -5}, ValueError, "host_memory_limit"),
        ({"double_buffering": None}, TypeError, "double_buffering"),
        ({"tensor_filter": 3}, TypeError, "tensor_filter"),
        ({"timing": "yes"}, TypeError, "timing"),
    ],
)
def test_bad_keywords(kwargs, error, names) -> None:
    with pytest.raises(error, match=re.escape(names)):
        offload.ActivationOffloader(layers(), **kwargs)


def test_bad_layers() -> None:
    with pytest.raises(TypeError, match="layers"):
        offload.ActivationOffloader(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        offload.ActivationOffloader([nn.Linear(2, 2), "x"])
    with pytest.raises(ValueError, match="empty"):
        offload.ActivationOffloader([])
    with pytest.raises(TypeError, match="layers"):
        offload.ActivationOffloader(5)


def test_config_and_keywords_are_exclusive() -> None:
    cfg = offload.OffloadConfig(offload_layers=1)
    with pytest.raises(TypeError, match="not both"):
        offload.ActivationOffloader(layers(), config=cfg, min_tensor_bytes=0)
    with pytest.raises(TypeError, match="OffloadConfig"):
        offload.ActivationOffloader(layers(), config={"offload_layers": 1})
    off = offload.ActivationOffloader(layers(), config=cfg)
    assert off.config is cfg


def test_config_is_frozen_and_normalised() -> None:
    cfg = offload.OffloadConfig(offload_layers=[2, 0])
    assert cfg.offload_layers == (0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.min_tensor_bytes = 0  # type: ignore[misc]
    assert offload.OffloadConfig().min_tensor_bytes == 256 * 1024
    assert offload.OffloadConfig().double_buffering is False


def test_import_does_not_initialise_cuda() -> None:
    code = (
        "import torch, offload\n"
        "off = offload.ActivationOffloader([torch.nn.Linear(2, 2)])\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_names() -> None:
    for name in offload.__all__:
        assert hasattr(offload, name), name
    assert {"ActivationOffloader", "OffloadConfig", "no_offload", "get_cpu_offload_context"} <= set(
        offload.__all__
    )
