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


def test_sets_flag_parsing():
    """--sets of both acceptance benches: spaces and a trailing comma are forgiven, a repeated
    name counts once, nothing at all or an unknown name is refused."""
    from bench.datasets import parse_sets

    assert parse_sets("humaneval, stdlib,") == ("humaneval", "stdlib")
    assert parse_sets("stdlib,stdlib") == ("stdlib",)
    for bad, msg in (("", "no prompt set"), (" , ", "no prompt set"), ("humaneval,gsm8k", "['gsm8k']")):
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            parse_sets(bad)


def test_acceptance_sets_name_their_results_file(tmp_path, monkeypatch, capsys):
    """bench.acceptance --sets: only humaneval + mtbench write acceptance.json (what --merge
    writes); any other choice writes acceptance-<sets>.json, never another run's file; every
    named set runs; an unknown name is a usage error before the engines load."""
    import json
    import types

    import bench.acceptance as A

    class Tok:
        eos_token_ids = [0]

        def encode(self, s):
            return [1, 2]

        def apply_chat_template(self, m):
            return m[0]["content"]

    engines = (None, types.SimpleNamespace(cfg=types.SimpleNamespace(block_size=8)), Tok())
    monkeypatch.setattr(A, "RESULTS", tmp_path)
    monkeypatch.setattr(A, "load_engines", lambda *a, **k: engines)
    monkeypatch.setattr(A, "measure", lambda *a, **k: {"tau": 1.0, "p_accept_ge": [0.0] * 7, "seconds": 0})
    for sets, stem in (("stdlib,humaneval", "acceptance-stdlib-humaneval"),
                       ("humaneval,mtbench,stdlib", "acceptance-humaneval-mtbench-stdlib"),
                       ("humaneval, stdlib", "acceptance-humaneval-stdlib"), ("mtbench,humaneval", "acceptance")):
        for f in tmp_path.iterdir():
            f.unlink()
        A.main(["--n", "1", "--budgets", "4", "--no-extra-budgets", "--sets", sets])
        assert sorted(f.name for f in tmp_path.glob("*.json")) == [stem + ".json"]
        keys = json.loads((tmp_path / f"{stem}.json").read_text())["results"]
        assert {k.split("/")[0] for k in keys} == {s.strip() for s in sets.split(",")}
    monkeypatch.setattr(A, "load_engines", lambda *a, **k: pytest.fail("engines loaded"))
    with pytest.raises(SystemExit) as e:
        A.main(["--sets", "gsm8k"])
    assert e.value.code == 2 and "--sets: unknown prompt sets ['gsm8k']" in capsys.readouterr().err


def test_acceptance_plot_refuses_what_it_cannot_merge(tmp_path):
    """bench.plot_acceptance: two drafters' (or block sizes') results for the same set and T are
    not one curve; a key without "set/" (another bench's file) and an empty file are named errors."""
    import json

    from bench.plot_acceptance import curves, main

    a = {"meta": {"block_size": 8, "drafter": "A"}, "results": {"stdlib/tree@64": {"tau": 4.0}}}
    b = {"meta": {"block_size": 16, "drafter": "A"}, "results": {"stdlib/tree@64": {"tau": 5.0}}}
    with pytest.raises(ValueError, match="one curve"):
        curves([a, b])
    with pytest.raises(ValueError, match="one curve"):
        curves([a, {**a, "meta": {"block_size": 8, "drafter": "B"}}])
    assert curves([a, {**b, "meta": {"block_size": 16, "drafter": "A", "temperature": 1.0}}])  # another T: fine
    with pytest.raises(ValueError, match="set/mode"):
        curves([{"meta": {}, "results": {"shipped": {"T0/stdlib/chain": {"tau": 1.0}}}}])
    (tmp_path / "e.json").write_text(json.dumps({"meta": {}, "results": {}}))
    with pytest.raises(SystemExit):
        main([str(tmp_path / "e.json"), "--out", str(tmp_path / "e.png")])
    assert not (tmp_path / "e.png").exists()
