"""bench.concurrency_pool: adaptive ÷ a fixed configuration paired within each repeat, pooled over
runs — on hand-made rows, and on the committed H200 runs behind plans/0009 "Session 14"'s table."""
import argparse
import math
import pathlib
import statistics

import pytest

from bench.concurrency_pool import main, markdown, non_inferior, paired_ratios, parse_against, pool

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"


def row(config, c, rep, tok_s):
    return dict(config=config, c=c, rep=rep, tok_s=tok_s)


def test_ratios_pair_repeats_and_skip_what_is_missing():
    a = [row("adaptive", 1, 0, 90.0), row("tree@64", 1, 0, 100.0), row("adaptive", 1, 1, 120.0),
         row("tree@64", 1, 1, 100.0), row("adaptive", 1, 2, 50.0),                       # repeat 2: no tree@64
         row("adaptive", 1, 3, 80.0), row("tree@64", 1, 3, 0.0),                          # 0 tok/s: skipped
         row("tree@16", 4, 0, 10.0)]                                                      # no adaptive at c=4
    b = [row("tree@64", 1, 5, 100.0), row("adaptive", 1, 5, 99.0)]                      # rows in any order
    assert paired_ratios(a, 1, "tree@64") == [0.9, 1.2] and paired_ratios(a, 4, "tree@16") == []
    (p,) = pool({"a": a, "b": b, "none": [row("tree@64", 1, 0, 1.0)]}, {1: "tree@64", 4: "tree@16"})
    assert (p["c"], p["n"], p["below_1"], p["runs"]) == (1, 3, 2, [("a", 2), ("b", 1)])
    assert p["mean"] == pytest.approx((0.9 + 1.2 + 0.99) / 3) and p["median"] == pytest.approx(0.99)
    lo, hi = p["ci90"]
    assert lo < p["mean"] < hi and hi - p["mean"] == pytest.approx(p["mean"] - lo)
    # a run counted once: run a's geometric mean (0.9 · 1.2) ** 0.5 and run b's 0.99, a t interval on 1 dof
    a_gm, logs = (0.9 * 1.2) ** 0.5, [math.log((0.9 * 1.2) ** 0.5), math.log(0.99)]
    assert p["run_mean"] == pytest.approx((a_gm * 0.99) ** 0.5)
    half = 6.314 * statistics.stdev(logs) / 2 ** 0.5
    assert p["run_ci90"] == pytest.approx((p["run_mean"] / math.exp(half), p["run_mean"] * math.exp(half)))
    (one,) = pool({"b": b}, {1: "tree@64"})
    assert one["ci90"] is None and one["run_ci90"] is None  # one ratio, one run: no interval
    lo = p["run_ci90"][0]
    assert non_inferior(p, 1.0 - lo + 1e-9) is True and non_inferior(p, 1.0 - lo - 1e-9) is False
    assert non_inferior(one, 0.05) is None
    assert markdown([p, one], 0.05).splitlines()[2:] == [
        markdown([p, one]).splitlines()[2] + f" {'yes' if lo >= 0.95 else 'no'} |", markdown([p, one]).splitlines()[3] + " – |"]


def test_committed_runs_give_the_plans_table(capsys):
    runs = [RESULTS / f"concurrency_h200_{t}.json" for t in
            ("s11", "s12", "s12_plain", "s12_after_chain", "s13", "s14_c1c4", "s14_c16c64", "s14_c64")]
    assert main([str(f) for f in runs]) == 0
    lines = {line.split("|")[1].strip(): line.split("|")[2:8] for line in capsys.readouterr().out.splitlines()[2:]}
    # plans/0009 "Session 14", Pooled: c → (paired repeats, mean, median, below 1)
    for c, (n, m, med, below) in {"1": (20, "0.985", "0.974", 12), "4": (20, "1.006", "0.997", 10),
                                  "16": (22, "0.969", "0.990", 11), "64": (32, "0.967", "0.983", 17)}.items():
        cells = [x.strip() for x in lines[c]]
        assert (int(cells[1]), cells[2], cells[4], int(cells[5])) == (n, m, med, below)


def test_against_is_checked():
    assert parse_against("1:tree@64, 16:tree@16") == {1: "tree@64", 16: "tree@16"}
    for bad in ("", "tree@64", "x:tree@64", "1:"):
        with pytest.raises(argparse.ArgumentTypeError, match="C:CONFIG"):
            parse_against(bad)


def test_runs_of_one_lease_count_once(tmp_path, capsys, monkeypatch):
    """Two runs of one lease are one sample of the lease-to-lease spread: their log means are averaged
    into the lease's, and the t interval has one degree of freedom fewer than with the runs apart."""
    a = [row("adaptive", 64, 0, 90.0), row("tree@16", 64, 0, 100.0)]
    b = [row("adaptive", 64, 0, 95.0), row("tree@16", 64, 0, 100.0)]
    c = [row("adaptive", 64, 0, 102.0), row("tree@16", 64, 0, 100.0)]
    (apart,) = pool({"a": a, "b": b, "c": c}, {64: "tree@16"})
    (joined,) = pool({"a": a, "b": b, "c": c}, {64: "tree@16"}, lease={"a": "L", "b": "L"})
    assert (apart["leases"], joined["leases"], joined["n"]) == (3, 2, 3)  # (every paired repeat still listed)
    lease_l = (math.log(0.9) + math.log(0.95)) / 2
    assert joined["run_mean"] == pytest.approx(math.exp((lease_l + math.log(1.02)) / 2))
    half = 6.314 * statistics.stdev([lease_l, math.log(1.02)]) / 2 ** 0.5
    assert joined["run_ci90"][0] == pytest.approx(joined["run_mean"] / math.exp(half))
    assert joined["run_ci90"][0] < apart["run_ci90"][0]  # fewer leases, a wider interval here
    files = []
    for name, rows in (("a", a), ("b", b), ("c", c)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(__import__("json").dumps({"rows": rows}))
    assert main([str(f) for f in files] + ["--against", "64:tree@16", "--lease", f"{files[0]},{files[1]}"]) == 0
    assert "| 2 | " in capsys.readouterr().out
    capsys.readouterr()
    # names are stripped and paths resolved; the same file named two ways is one run
    rel = [f"{f.parent}/../{f.parent.name}/{f.name}" for f in files]
    assert main(rel + [str(files[0]), "--against", "64:tree@16", "--lease", f" {files[0]}, {rel[1]} "]) == 0
    out = capsys.readouterr().out.splitlines()[2].split("|")
    assert (out[3].strip(), out[9].strip()) == ("3", "2")  # 3 paired repeats, 2 leases
    # a group is keyed apart from run names: a run named like a group's text stays its own lease
    odd = tmp_path / f"{files[0].name}.json"  # its run's name (stem) is "a.json", the group's text below
    odd.write_text(files[2].read_text())
    monkeypatch.chdir(tmp_path)
    assert main([files[0].name, odd.name, "--against", "64:tree@16", "--lease", files[0].name]) == 0
    assert capsys.readouterr().out.splitlines()[2].split("|")[9].strip() == "2"
    (tmp_path / "norows.json").write_text("{}")
    for bad in (["--lease", str(tmp_path / "other.json")],  # not among the runs
                [str(tmp_path / "missing.json")], [str(tmp_path / "norows.json")],  # not a run: argparse's error
                ["--lease", f"{files[0]},{files[1]}", "--lease", f"{files[1]},{files[2]}"]):  # a run in two groups
        with pytest.raises(SystemExit):
            main([str(f) for f in files] + bad)
