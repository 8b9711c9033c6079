"""``AutoSettings``: the frozen tuning of ``offload_layers="auto"``, checked at
construction and honoured where it is passed."""

from __future__ import annotations

import dataclasses

import pytest

from offload.activations._auto._fit import ShapeModel
from offload.activations._auto._policy import AutoPolicy
from offload.activations._auto._predict import LayerCost, predict_step
from offload.activations._auto._settings import DEFAULT_AUTO, AutoSettings


def test_defaults_are_frozen_and_checked() -> None:
    s = AutoSettings()
    assert s == DEFAULT_AUTO and s.verify_steps == 5 and s.memory_margin == 0.05
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.watch_every = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="AutoSettings.max_points"):
        AutoSettings(max_points=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AutoSettings.watch_every"):
        AutoSettings(watch_every=True)
    with pytest.raises(ValueError, match="AutoSettings.memory_margin"):
        AutoSettings(memory_margin=1.5)
    with pytest.raises(ValueError, match="min_pairs"):
        AutoSettings(min_pairs=6, verify_steps=5)


def test_policy_hands_its_settings_on() -> None:
    tuned = AutoSettings(max_points=2, host_seconds_per_copy=1e-3)
    assert AutoPolicy().settings is DEFAULT_AUTO
    assert AutoPolicy(settings=tuned).settings is tuned
    with pytest.raises(TypeError, match="settings"):
        AutoPolicy(settings={"max_points": 2})  # type: ignore[arg-type]
    model = ShapeModel(3, tuned)
    assert model.settings.max_points == 2
    # the host's work per copy paces a launch-bound layer once offloaded
    costs = [LayerCost(1e-3, 2e-3, 0, 1e-3, 2e-3, copies=10)] * 3
    slow = predict_step(costs, [0], 1e12, 1e12, None, 0.0, tuned.host_seconds_per_copy)
    assert slow > predict_step(costs, [0], 1e12, 1e12, None, 0.0)
