"""``PlannerSettings``: the frozen tuning of ``offload.plan``, checked at construction."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload
from offload._planner.plan import Plan
from offload._planner.settings import DEFAULT_PLANNER, PlannerSettings


def test_defaults_are_frozen_and_checked() -> None:
    s = PlannerSettings()
    assert s == DEFAULT_PLANNER and s.verify_rounds == 2 and s.full_search == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.verify_gain = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError, match="PlannerSettings.polished"):
        PlannerSettings(polished=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PlannerSettings.verify_single"):
        PlannerSettings(verify_single=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="PlannerSettings.verify_gain"):
        PlannerSettings(verify_gain=2.0)
    assert PlannerSettings(verify_excess=float("inf")).verify_excess == float("inf")


def test_plan_checks_its_settings() -> None:
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    with pytest.raises(TypeError, match="settings"):
        offload.plan(lambda: None, layers, budget=0.5, settings={"polished": 1})  # type: ignore[arg-type]
    assert Plan(layers, ["keep", "keep"])._settings is DEFAULT_PLANNER
