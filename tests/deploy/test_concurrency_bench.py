"""bench.concurrency: its per-cell statistics on hand-made records (fast tier), and its cells on
the session stack (real services, loopback; slow tier: a timed window on 2 shared cores is too
slow and too load-dependent for CI). A check of the bench, not a measurement."""
from __future__ import annotations

import json

import pytest

from bench import concurrency
from bench.concurrency import Record


def test_summarise_counts_only_the_window():
    """Window [10, 12): tokens of deltas inside it; TTFT of requests sent inside it whose first
    token came before its end; ITL per token = gap ÷ tokens of the later delta, one sample per
    token; completed = Finals inside; our own cut (CUT) is no error, any status is."""
    recs = [
        # started in the warm-up: its first delta (t=9.9) is outside; gaps 0.3/3 tokens and 0.2/1
        Record(0, 0, 9.5, deltas=[(9.9, 1), (10.2, 3), (10.4, 1)], status="OK", final_at=10.4, completion_tokens=5,
               rounds=3),
        # sent in the window, first token at 10.6 (TTFT 0.5), gap 0.4 for 2 tokens, cut at the end
        Record(1, 1, 10.1, deltas=[(10.6, 1), (11.0, 2)]),
        # sent in the window, first token after its end: no TTFT sample, no tokens
        Record(1, 0, 11.9, deltas=[(12.1, 1)]),
        Record(2, 1, 10.0, status="UNAVAILABLE", details="target down"),
    ]
    s = concurrency.summarise(recs, 10.0, 12.0)
    assert s["tokens"] == 3 + 1 + 1 + 2 and s["tok_s"] == 3.5
    assert (s["ttft_n"], s["ttft_p50"]) == (1, 500.0)
    # per-token samples: 0.1 ×3, 0.2, 0.2 ×2 → median 0.15 s; delta gaps 0.3, 0.2, 0.4
    assert (s["itl_p50"], s["gap_p50"], s["deltas"], s["tokens_per_delta"]) == (150.0, 300.0, 3, 2.0)
    assert (s["completed"], s["errors"], s["tau"]) == (1, 1, round(5 / 3, 3))
    assert s["error_examples"] == ["UNAVAILABLE: target down"]


def test_ratios_and_identity():
    """×AR divides by the autoregressive cell of the same c; identity compares each completed
    output with the AR output of its prompt from the smallest c that completed it (prompt 1's
    from c=4, which the tree@4 output at c=1 does not match)."""
    rows = [dict(config="autoregressive", c=1, tok_s=10.0, _outputs=[(0, [1, 2])]),
            dict(config="tree@4", c=1, tok_s=15.0, _outputs=[(0, [1, 2]), (1, [5])]),
            dict(config="autoregressive", c=4, tok_s=20.0, _outputs=[(0, [1, 2]), (1, [7])]),
            dict(config="tree@4", c=4, tok_s=30.0, _outputs=[(0, [1, 3]), (1, [7])])]
    concurrency.add_ratios_and_identity(rows)
    assert [r["x_ar"] for r in rows] == [1.0, 1.5, 1.0, 1.5]
    assert [r["identical"] for r in rows] == ["1/1", "1/2", "2/2", "1/2"]
    assert all("_outputs" not in r for r in rows)


def test_metric_deltas():
    """Mean batch per op from a histogram's Δsum/Δcount over the cell; shape counters as shares
    and their Δ total as rounds; the process collector's CPU seconds as their Δ."""
    b = {("specdec:worker_batch_size_count", (("op", "verify"),)): 10.0,
         ("specdec:worker_batch_size_sum", (("op", "verify"),)): 20.0}
    a = {("specdec:worker_batch_size_count", (("op", "verify"),)): 20.0,
         ("specdec:worker_batch_size_sum", (("op", "verify"),)): 60.0,
         ("specdec:round_shape_total", (("shape", "tree@16"),)): 8.0,
         ("specdec:round_shape_total", (("shape", "one-token"),)): 2.0}
    b[("process_cpu_seconds_total", ())], a[("process_cpu_seconds_total", ())] = 3.25, 4.0
    assert concurrency.metric_deltas(b, a) == {"mean_batch_verify": 4.0, "shapes": "tree@16 80%, one-token 20%",
                                                "rounds": 10, "cpu_s": 0.75}
    assert concurrency.metric_deltas(a, a) == {"cpu_s": 0.0}


def test_repeats_run_interleaved():
    """--repeat: each repeat at a c runs the configurations in the reverse order of the one
    before; --once configurations run in the first repeat only."""
    order = concurrency.cell_order(["autoregressive", "tree@16", "adaptive"], 4, ("autoregressive",))
    assert order == [(0, "autoregressive"), (0, "tree@16"), (0, "adaptive"), (1, "adaptive"), (1, "tree@16"),
                     (2, "tree@16"), (2, "adaptive"), (3, "adaptive"), (3, "tree@16")]
    assert concurrency.cell_order(["a", "b"]) == [(0, "a"), (0, "b")]


def test_repeat_summary_and_report(tmp_path):
    """Repeated cells: per c the ratio of the means against the best fixed configuration by mean,
    the per-repeat ratios (same repeat) and a bootstrap interval that contains the ratio of means;
    the report lists each cell's mean and spread; a single run's report has neither (unchanged)."""
    rows = []
    for rep, (ad, t16, t64) in enumerate([(100, 98, 90), (104, 100, 91), (99, 99, 92), (101, 97, 89)]):
        for name, v in (("tree@16", t16), ("tree@64", t64), ("adaptive", ad)):
            rows.append(dict(config=name, c=4, rep=rep, tok_s=float(v), error_examples=[]))
    rows.insert(0, dict(config="autoregressive", c=4, rep=0, tok_s=50.0, error_examples=[]))
    # a diagnostic adaptive@N cell (an adaptive policy under another cap) is not a fixed configuration
    rows.append(dict(config="adaptive@16", c=4, rep=0, tok_s=500.0, error_examples=[]))
    assert concurrency.parse_config("adaptive@16") == ("tree", 16, "adaptive")
    (s,) = concurrency.repeat_summary(rows)
    assert (s["best"], s["n"], s["adaptive"], s["best_tok_s"]) == ("tree@16", 4, 101.0, 98.5)
    assert s["ratio"] == round(101 / 98.5, 4) and s["rep_ratios"] == [round(a / b, 4) for a, b in
                                                                      ((100, 98), (104, 100), (99, 99), (101, 97))]
    assert s["ci90"][0] <= s["ratio"] <= s["ci90"][1] and s["ci90"][0] >= min(s["rep_ratios"]) - 1e-9
    assert s["median_ratio"] == round(100.5 / 98.5, 4) and s["same_shape"] is None  # no shapes exported
    # one host-slowed adaptive cell moves the mean, not the median; the shape column gives adaptive's share
    # of rounds in the best fixed configuration's shape
    slowed = [dict(r, tok_s=80.0) if (r["config"], r["rep"]) == ("adaptive", 3) else r for r in rows]
    for r, shapes in zip([r for r in slowed if r["config"] == "adaptive"], ["tree@16 96%, tree@4 4%", "tree@16 100%",
                                                                             "tree@4 60%, tree@16 40%", ""]):
        r["orchestrator_shapes"] = shapes
    (t,) = concurrency.repeat_summary(slowed)
    assert t["ratio"] < 0.975 and t["median_ratio"] == round(99.5 / 98.5, 4) and t["same_shape"] == round(2.36 / 3, 3)
    # plans/0009 session 25's rule: ratio of means >= 0.97 and the 90 % interval reaching 1
    assert s["rule"] == "holds" and t["ci90"][1] >= 1.0 and t["ratio"] >= 0.97 and t["rule"] == "holds"
    low = [dict(r, tok_s=r["tok_s"] * 0.9) if r["config"] == "adaptive" else r for r in rows]
    assert concurrency.repeat_summary(low)[0]["rule"] == "fails"
    assert concurrency.shape_share("one-token 3%, tree@64 97%", "tree@64") == 0.97
    assert concurrency.shape_share("one-token 100%", "tree@64") == 0.0 and concurrency.shape_share("", "x") is None
    meta = dict(tag="t", device="cpu", max_tokens=8, temperature=0.0)
    text = concurrency.write(meta, rows, [], tmp_path, "t", png=True)
    assert "| tree@16 | 4 | 4 | 98.5 |" in text and "per repeat 1.000–1.041" in text and "bootstrap 90 %" in text
    assert "ratio of medians 1.020" in text and "the rule of plans/0009 session 25: holds" in text
    assert json.loads((tmp_path / "concurrency_t.json").read_text())["repeat_summary"][0]["best"] == "tree@16"
    single = [r for r in rows if r["rep"] == 0]
    text = concurrency.write(meta, single, [], tmp_path, "t", png=False)
    assert "Repeated cells" not in text and "| 4 | 100.0 | 2.0 | 1.020 × the best fixed (tree@16, 98.0 tok/s) |" in text


@pytest.mark.slow
def test_concurrency_cells_smoke(stack):
    """Autoregressive, tree@4 and (where the client has the policy) adaptive at c = 1 and 2, 4 s
    windows, 4-token requests on the session stack: every cell streams tokens in its window with
    no errors and leaves no live request or KV row behind; each completes requests whose outputs
    equal the autoregressive ones; the report names every cell."""
    configs = ["autoregressive", "tree@4"] + (["adaptive"] if concurrency.adaptive_supported() else [])
    args = concurrency.parser().parse_args(["--concurrency", "1,2", "--seconds", "4", "--warmup", "1",
                                            "--max-tokens", "4", "--prompts", "2"])
    rows = concurrency.run_cells(args, configs, stack, stack.metrics_ports, log=lambda *a, **k: None)
    assert [(r["config"], r["c"]) for r in rows] == [(name, c) for c in (1, 2) for name in configs]
    for r in rows:
        assert r["errors"] == 0 and r["idle_after"], r
        assert r["tokens"] > 0 and r["tok_s"] == round(r["tokens"] / 4, 2), r
        assert r["completed"] > 0, r
        same, checked = map(int, r["identical"].split("/"))
        assert same == checked > 0, r
    assert all(r["tau"] < 1.5 for r in rows if r["config"] == "autoregressive")  # one token per round
    text = concurrency.markdown(dict(tag="t", device="cpu"), rows, [])
    assert sum(line.startswith(tuple(f"| {n} |" for n in configs)) for line in text.splitlines()) == len(rows)
    json.dumps(rows)


def test_repeat_summary_matches_chain_shapes_and_survives_a_zero_median():
    """The fixed "chain" configuration's rounds are exported as "chain@7": adaptive running chain
    rounds is in its shape; a best fixed configuration with cells at 0 tok/s (every request
    failed) and median 0 gives no ratio of medians and no per-repeat ratio for those repeats,
    rather than a ZeroDivisionError in the report."""
    assert concurrency.shape_share("chain@7 90%, tree@16 10%", "chain") == 0.9
    assert concurrency.shape_share("chain@7 90%, tree@16 10%", "tree@1") == 0.0
    rows = [dict(config=n, c=1, rep=k, tok_s=t, error_examples=[], orchestrator_shapes=sh) for k in range(3)
            for n, t, sh in (("chain", 100.0, "chain@7 100%"), ("tree@16", 90.0, "tree@16 100%"),
                             ("adaptive", 101.0, "chain@7 100%"))]
    (s,) = concurrency.repeat_summary(rows)
    assert s["best"] == "chain" and s["same_shape"] == 1.0
    rows = [dict(config=n, c=1, rep=k, tok_s=t, error_examples=[]) for k, t16 in enumerate((0.0, 0.0, 300.0))
            for n, t in (("tree@16", t16), ("tree@64", 40.0), ("adaptive", 50.0))]
    (s,) = concurrency.repeat_summary(rows)
    assert s["best"] == "tree@16" and s["median_ratio"] is None and s["rep_ratios"] == [round(50 / 300, 4)]
    (line,) = [x for x in concurrency.goals(rows) if x.startswith("| 1 |")]
    assert "best fixed (tree@16" in line and "ratio of medians" not in line
