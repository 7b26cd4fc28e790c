"""bench.spy: py-spy's collapsed stacks read into µs per round by function, and two configurations
compared; a real recording where py-spy is installed (CI has none: that test skips there)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from bench import spy

RAW_A = """\
<module> (serve.py:1);generate (orchestrator/generation.py:253);next_shape (orchestrator/adaptive.py:380) 10
<module> (serve.py:1);generate (orchestrator/generation.py:260) 30
<module> (serve.py:1);generate (orchestrator/generation.py:253);generate (orchestrator/generation.py:300) 5
"""
RAW_B = """\
<module> (serve.py:1);generate (orchestrator/generation.py:253);next_shape (orchestrator/adaptive.py:380) 40
<module> (serve.py:1);generate (orchestrator/generation.py:260) 30
"""


def test_stacks_become_own_and_inclusive_samples_per_function():
    own, incl = spy.by_function(spy.frames_from(RAW_A))
    gen, shape = "generate (orchestrator/generation.py)", "next_shape (orchestrator/adaptive.py)"
    assert own == {shape: 10, gen: 35}  # line numbers dropped: one function
    assert incl == {"<module> (serve.py)": 45, gen: 45, shape: 10}  # recursion counted once


def test_two_configurations_compare_per_round(tmp_path):
    (tmp_path / "a.txt").write_text(RAW_A)
    (tmp_path / "b.txt").write_text(RAW_B)
    rows = [dict(config="tree@16", c=64, rep=0, orchestrator_rounds=1000, py_spy={"orchestrator": "a.txt"}),
            dict(config="adaptive@16", c=64, rep=0, orchestrator_rounds=500, py_spy={"orchestrator": "b.txt"}),
            dict(config="adaptive@16", c=64, rep=1, orchestrator_rounds=500, py_spy={"orchestrator": "b.txt"}),
            dict(config="adaptive@16", c=16, rep=0, orchestrator_rounds=7, py_spy={"orchestrator": "a.txt"})]
    own, _, rounds = spy.per_round(rows, tmp_path, 64, "adaptive@16", "orchestrator", rate=100)
    # two cells of 40 samples at 100 Hz = 0.8 s over 1000 rounds: 800 µs per round
    assert rounds == 1000 and own["next_shape (orchestrator/adaptive.py)"] == pytest.approx(800.0)
    md = spy.compare(rows, tmp_path, 64, "tree@16", "adaptive@16", rate=100, top=1)
    assert "| `next_shape (orchestrator/adaptive.py)` | 100.00 | 800.00 | +700.00 |" in md
    with pytest.raises(ValueError, match="no draft profile"):
        spy.per_round(rows, tmp_path, 64, "tree@16", "draft", rate=100)


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_a_recording_finds_the_function_a_process_spends_its_time_in(tmp_path):
    busy = textwrap.dedent("""
        import time
        def spin_here():
            end = time.monotonic() + 30
            while time.monotonic() < end:
                sum(range(200))
        print("ready", flush=True)
        spin_here()
    """)
    proc = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        spies = spy.start({"orchestrator": proc.pid}, str(tmp_path), "c1_x_r0", rate=100)
        time.sleep(1.0)
        names = spy.finish(spies)
    finally:
        proc.kill()
        proc.wait()
    if "orchestrator" not in names:
        pytest.skip("py-spy could not attach here (ptrace not permitted)")
    own, _ = spy.by_function(spy.frames(str(tmp_path / names["orchestrator"])))
    assert names["orchestrator"] == "c1_x_r0_orchestrator.txt"
    assert max(own, key=own.get).startswith("spin_here (<string>")
