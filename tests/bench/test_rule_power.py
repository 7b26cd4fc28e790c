"""bench.rule_power: the rule's power, and the lease noise it is read at, on synthetic runs whose answer is known."""
from __future__ import annotations

import json
import math

import pytest

from bench.rule_power import lease_noise, power

MEANS = {"tree@4": 900.0, "tree@16": 1000.0, "tree@64": 950.0}


def test_with_little_noise_the_rule_holds_for_a_better_planner_and_fails_a_worse_one():
    assert power(MEANS, 0.001, 3, gain=1.01, trials=20) == 1.0
    assert power(MEANS, 0.001, 3, gain=0.96, trials=20) == 0.0
    # an exactly equal one: the interval must reach 1, which fails whenever every repeat falls below by a hair
    assert 0.5 < power(MEANS, 0.001, 3, gain=1.0, trials=40) < 1.0


def test_at_a_c_64_leases_noise_an_equal_planner_fails_the_rule_often():
    # session 25's c = 64 per-cell noise (σ 0.125): the ratio of means falls below 0.97 by noise alone
    p = power(MEANS, 0.125, 3, gain=1.0, trials=60)
    assert 0.2 < p < 0.8, p


def _run(path, cells):
    rows = [dict(config=n, c=c, rep=r, tok_s=v) for (n, c), reps in cells.items() for r, v in enumerate(reps)]
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_lease_noise_reads_the_spread_of_repeated_fixed_cells(tmp_path):
    a = _run(tmp_path / "a.json", {("tree@16", 64): [1000.0, 1000.0 * math.e ** 0.2], ("tree@4", 64): [900.0, 900.0],
                                   ("adaptive", 64): [950.0, 950.0 * math.e ** 0.2], ("autoregressive", 64): [1.0]})
    b = _run(tmp_path / "b.json", {("tree@16", 64): [1000.0], ("adaptive", 64): [1050.0]})  # (no repeat: no spread)
    noise = lease_noise([a, b])[64]
    # one repeated pair differs by 0.2 in log, the other not: pooled variance (0.02 + 0) / 2 dof
    assert noise["sigma"] == pytest.approx(0.1) and noise["dof"] == 2
    assert set(noise["means"]) == {"tree@16", "tree@4"}  # fixed configurations only, over every run
    assert noise["means"]["tree@16"] == pytest.approx(1000.0 * (2 + math.e ** 0.2) / 3)
