"""The acceptance benches' prompt sets (HumanEval, MT-Bench, the stdlib third set) and the
τ-vs-budget plot (issue 9 item 3)."""
import pytest


def test_acceptance_services_prompt_sets(capsys):
    """bench.acceptance_services --sets: the third set (stdlib function prompts, raw) beside
    HumanEval and MT-Bench; an unknown name is a usage error before any service starts."""
    from bench.acceptance_services import main, requests
    from bench.datasets import stdlib_prompts

    r = requests(2, ("stdlib", "mtbench"))
    assert list(r) == ["stdlib", "mtbench"] and r["stdlib"] == [dict(prompt=p) for p in stdlib_prompts(2)]
    assert "messages" in r["mtbench"][0] and list(requests(1)) == ["humaneval", "mtbench"]
    with pytest.raises(SystemExit) as e:
        main(["--drafters", "a=/nonexistent", "--sets", "humaneval,gsm8k"])
    assert e.value.code == 2 and "--sets: unknown prompt sets ['gsm8k']" in capsys.readouterr().err


def test_acceptance_plot_merges_files_per_set_and_temperature(tmp_path):
    """bench.plot_acceptance: results split over processes merge per (set, T); budgets ascend,
    chain sits at block size − 1 nodes; an unknown mode is refused; the plot is written."""
    import json

    from bench.plot_acceptance import curves, main

    a = {"meta": {"temperature": 0.0, "block_size": 8},
         "results": {"stdlib/chain": {"tau": 2.7}, "stdlib/tree@64": {"tau": 4.0}, "stdlib/tree@4": {"tau": 2.9}}}
    b = {"meta": {"temperature": 0.0, "block_size": 8}, "results": {"stdlib/tree@512": {"tau": 4.6}}}
    c = {"meta": {"temperature": 1.0, "block_size": 8}, "results": {"stdlib/tree@64": {"tau": 2.3}}}
    got = curves([a, b, c])
    assert got[("stdlib", 0.0)] == {"tree": [(4, 2.9), (64, 4.0), (512, 4.6)], "chain": (7, 2.7)}
    assert got[("stdlib", 1.0)] == {"tree": [(64, 2.3)], "chain": None}
    with pytest.raises(ValueError, match="unknown mode"):
        curves([{"meta": {}, "results": {"x/beam@4": {"tau": 1.0}}}])
    files = []
    for i, d in enumerate((a, b, c)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(d))
    main([*map(str, files), "--out", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").stat().st_size > 1000
