"""bench/mla_kernel.py's --vs-prefix columns: names checked when parsed (a typo or an empty item
is refused before any GPU work, not timed under a wrong label or turned into an error on every
row), and the markdown table puts each launch's time under its own header whatever the row holds.
CPU-only (no kernel runs). The bench module is imported inside the tests: importing it at
collection would import the kernels before tests/kernels/conftest.py selects Triton's interpreter."""
import re

import pytest


def test_vs_prefix_names_are_checked_when_parsed():
    from bench.mla_kernel import main, prefix_names

    assert prefix_names("") == [] and prefix_names("triton,") == ["triton"]
    assert prefix_names("triton, gluon-ws,,triton") == ["triton", "gluon-ws"]
    assert prefix_names("gluon@1024,gluon") == ["gluon@1024", "gluon"]  # another chunk: its own column
    assert prefix_names("gluon+rows,triton@512+leaders") == ["gluon+rows", "triton@512+leaders"]
    assert prefix_names("gluon@1024,gluon@01024") == ["gluon@1024"]  # the same launch: one column
    assert prefix_names("gluon+rows+m16+w4,gluon+m16") == ["gluon+rows+m16+w4", "gluon+m16"]  # tree-launch knobs
    assert prefix_names("gluon+m16+rows,gluon+rows+m16") == ["gluon+m16+rows"]  # the same knobs: one column
    assert prefix_names("gluon+crow,gluon+chead+m16") == ["gluon+crow", "gluon+chead+m16"]  # the combine launch
    assert prefix_names("gluon+s1,gluon+s1+rows") == ["gluon+s1", "gluon+s1+rows"]  # pipelined gathers
    from bench.mla_kernel import vs_launch
    assert vs_launch("gluon+s1+m16") == ("gluon", {"tail_stages": 1, "tail_m": 16})
    for bad in ("gluon-wss", "cutlass", "triton,sdpa", "gluon@", "gluon@1000", "gluon@32", "sdpa@1024",
                "gluon+", "gluon+row", "gluon@1024+", "gluon+rows@1024", "triton+fused", "gluon+fused",
                "gluon@\u0662\u0660\u0664\u0668", "gluon@\u00b2", "gluon+m", "gluon+m12", "gluon+w0",
                "gluon+rows+leaders", "gluon+m16+m32", "gluon+s3", "gluon+s1+s2", "gluon+x16", "gluon+m\u00b2", "gluon+crow+chead"):  # (Arabic-Indic 2048, superscript 2)
        with pytest.raises(SystemExit) as e:
            main(["--vs-prefix", bad])
        assert e.value.code == 2


def test_split_shapes_are_checked_when_parsed():
    from bench.mla_kernel import main, split_shapes

    assert split_shapes("1024/256/32, 4096/8/8") == ((1024, 256, 32), (4096, 8, 8))
    for bad in ("", "1024/256", "1024/256/0", "a/b/c", "1024/256/32/1"):
        with pytest.raises(SystemExit) as e:
            main(["--split-shapes", bad])
        assert e.value.code == 2


def test_markdown_puts_each_launch_under_its_header():
    from bench.mla_kernel import markdown

    meta = dict(device="x", copy_gbs=1.0, matmul_tflops=1.0, tiling="{}", vs_prefix=["triton", "gluon-sync"])
    row = dict(L=1024, n=8, B=1, kv_mb=1.2, kernel_ms=1.0, eager_ms=1.5, tflops=3.0, floor_mem_ms=0.1,
               floor_flop_ms=0.1, x_floor=10.0, sdpa_ms=2.0, rel_err=1e-3)
    rows = [dict(row, vs_ms={"gluon-sync": 0.5}),                                  # triton not measured
            dict(row, vs_ms={"gluon-sync": 4.0, "triton": 2.0}),                   # another order
            dict(row, vs_ms={"triton": "ValueError: prefix 'gluon' needs bf16", "gluon-sync": 0.25}),
            dict(L=4096, n=8, B=1, error="RuntimeError: out of memory")]
    table = [line for line in markdown(meta, rows, {}).splitlines() if line.startswith("|")]
    width = table[0].count("|")
    assert [line.count("|") for line in table] == [width] * len(table)
    head = [c.strip() for c in table[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    tri, glu = head.index("triton prefix ms"), head.index("gluon-sync prefix ms")
    assert (cells[0][tri], cells[0][glu], cells[0][glu + 1]) == ("", "0.500", "2.000")
    assert (cells[1][tri], cells[1][tri + 1], cells[1][glu]) == ("2.000", "0.500", "4.000")
    assert re.match("ValueError", cells[2][tri]) and cells[2][glu] == "0.250"
    # the goal line counts each launch's own call time against the floor (≥ 32 MB of KV only)
    big = dict(row, kv_mb=40.0, floor_mem_ms=0.5, floor_flop_ms=0.2, x_floor=2.5)
    goal = markdown(meta, [dict(big, vs_ms={"triton": 1.0, "gluon-sync": 1.01}),        # 2.0× and 2.02×
                           dict(big, vs_ms={"triton": "error", "gluon-sync": 0.9}),
                           dict(row, vs_ms={"triton": 0.1, "gluon-sync": 0.1})], {}).splitlines()[-1]
    assert "met at 0 of 2 shapes" in goal and goal.endswith("triton 1 of 2, gluon-sync 1 of 2.")
    # a launch's output compared with the timed call's: marked in its cell and counted on the goal line
    md = markdown(meta, [dict(big, vs_ms={"triton": 1.0}, vs_same_bits={"triton": True}),
                         dict(big, vs_ms={"triton": 1.0, "gluon-sync": 0.9}, vs_same_bits={"triton": False})], {})
    assert "| 1.000 ≡ |" in md and "| 1.000 ≠ |" in md and "| 0.900 |" in md
    assert md.rstrip().endswith("bitwise equal to the timed call's (≡ in a cell; ≠ where not): triton at 1 of 2, "
                                "gluon-sync at 0 of 0.")


def test_checks_on_other_dtypes_let_the_triton_launch_stand_in_for_gluon():
    """--prefix gluon: the fp32 and tiny-model invariance checks run where Gluon does not apply
    ("auto": the Triton launch, the same bits) instead of recording a refusal."""
    from bench.mla_kernel import checkable

    assert checkable(dict(bn=32, prefix="gluon")) == dict(bn=32, prefix="auto")
    assert checkable(dict(prefix="triton")) == dict(prefix="triton") and checkable({}) == {}
