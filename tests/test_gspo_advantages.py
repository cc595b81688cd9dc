"""Group-normalised advantages: centred and scaled within each task's group, independent across groups."""

from __future__ import annotations

import statistics

import pytest

from gyre_ray.algo.advantages import group_advantages


def test_each_group_is_centred_and_scaled_by_its_own_std() -> None:
    rewards = {f"a{i}": r for i, r in enumerate([0.0, 1.0, 1.0, 0.5, 0.25])}
    rewards.update({f"b{i}": r for i, r in enumerate([10.0, 30.0])})
    groups = {k: k[0] for k in rewards}
    adv = group_advantages(rewards, groups, eps=0.0)
    for g in "ab":
        values = [adv[k] for k in rewards if k[0] == g]
        assert statistics.fmean(values) == pytest.approx(0.0, abs=1e-12)
        assert statistics.pstdev(values) == pytest.approx(1.0)
    assert adv["b0"] == pytest.approx(-1.0) and adv["b1"] == pytest.approx(1.0)
    # Order is kept: a higher reward never gets a lower advantage inside a group.
    assert adv["a1"] > adv["a3"] > adv["a4"] > adv["a0"]


def test_without_std_normalisation_advantages_are_centred_rewards() -> None:
    adv = group_advantages({"x": 1.0, "y": 3.0}, {"x": 0, "y": 0}, normalize_std=False)
    assert adv == {"x": pytest.approx(-1.0), "y": pytest.approx(1.0)}


def test_groups_without_signal_get_zero() -> None:
    adv = group_advantages({"x": 0.1, "y": 0.1, "z": 0.1, "solo": 5.0}, {"x": 1, "y": 1, "z": 1, "solo": 2})
    assert adv == {"x": 0.0, "y": 0.0, "z": 0.0, "solo": 0.0}


def test_bad_inputs_are_named() -> None:
    with pytest.raises(KeyError, match="execution 'x' has a reward but no group id"):
        group_advantages({"x": 1.0}, {})
    with pytest.raises(ValueError, match="execution 'x': reward nan is not a finite number"):
        group_advantages({"x": float("nan")}, {"x": 0})
