"""Orchestrator detokenization cost per pushed token against the output's length, this tree vs
another commit (e.g. before the incremental detokenizer).

  python -m bench.detok [--lengths 128,1024,4096] [--before COMMIT] [--repeat 5] [--tokenizer PATH]

An output of each length (English, Chinese and emoji text from the real tokenizer) is pushed
through ``orchestrator.stopping.OutputStream`` as the round loop does: 4 tokens a round, then
``take_delta``, with two stop strings that never match (so they are looked for every push).
µs / push: the whole output's time ÷ its tokens (min over repeats); last 10 %: the pushes of
the last tenth of it (what a push costs at that length). Each tree runs in its own process
with its packages first on the path (``--before``: ``git archive COMMIT modeling orchestrator``).
Writes bench/results/detok_<tag>.{json,md} (tag: cpu unless ``--tag``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXT = ("The tide comes in over the grey stones, and the gulls call out above the harbour. "
        "潮水漫过灰色的石头，海鸥在港口上空鸣叫。 🌊🐚 Waves again — naïve café. ")
ROUND = 4


def measure(lengths: list[int], repeat: int, tokenizer: str) -> dict:
    """{length: {us_per_push, us_per_push_last10}} for the OutputStream importable here."""
    from modeling.tokenizer import TextTokenizer
    from orchestrator.stopping import OutputStream

    tok = TextTokenizer.from_file(tokenizer)
    ids = tok.encode(TEXT * (max(lengths) // 20 + 1))
    out = {}
    for n in lengths:
        best, best_last = float("inf"), float("inf")
        for _ in range(repeat):
            stream = OutputStream(tok, ["<never>", "NEVER STOP"], {0}, n + 1)
            t0 = time.perf_counter()
            tail_from, t_tail = n - n // 10, None
            for i in range(0, n, ROUND):
                if t_tail is None and i >= tail_from:
                    t_tail, k_tail = time.perf_counter(), i
                for t in ids[i:min(i + ROUND, n)]:
                    stream.push(t)
                stream.take_delta()
            t1 = time.perf_counter()
            assert stream.text == tok.decode(ids[:n]).rstrip("\ufffd")
            best = min(best, (t1 - t0) / n)
            best_last = min(best_last, (t1 - t_tail) / (n - k_tail))
        out[n] = dict(us_per_push=round(best * 1e6, 2), us_per_push_last10=round(best_last * 1e6, 2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,1024,4096")
    ap.add_argument("--before", default="993c537", help="commit to compare with (its modeling/ and orchestrator/)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--tokenizer", default=os.environ.get("SPECDEC_GGUF", ""))
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    if not a.tokenizer:
        from modeling.model_files import default_gguf_path
        a.tokenizer = str(default_gguf_path())
    if a.measure:
        print(json.dumps(measure(lengths, a.repeat, a.tokenizer)))
        return 0
    rows = {}
    with tempfile.TemporaryDirectory() as before:
        archive = subprocess.run(["git", "archive", a.before, "modeling", "orchestrator"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
        for label, tree in ((a.before, before), ("this tree", str(ROOT))):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(ROOT)]))
            cmd = [sys.executable, "-c", "import sys, runpy; sys.argv = sys.argv[1:]; "
                   "runpy.run_path(sys.argv[0], run_name='__main__')", __file__, "--measure",
                   "--lengths", a.lengths, "--repeat", str(a.repeat), "--tokenizer", a.tokenizer]
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            rows[label] = json.loads(done.stdout.strip().splitlines()[-1])
    meta = dict(host=platform.node(), cpus=os.cpu_count(), python=platform.python_version(), repeat=a.repeat,
                load_average=round(os.getloadavg()[0], 2), when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    table = "| code | " + " | ".join(f"µs / push at {n} (whole output / last 10 %)" for n in lengths) + " |\n"
    table += "|---|" + "---|" * len(lengths) + "\n"
    for label, r in rows.items():
        table += f"| {label} | " + " | ".join(
            f"{r[str(n)]['us_per_push']:.1f} / {r[str(n)]['us_per_push_last10']:.1f}" for n in lengths) + " |\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"detok_{a.tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (RESULTS / f"detok_{a.tag}.md").write_text(
        f"# Detokenization per pushed token ({a.tag})\n\n`{json.dumps(meta)}`\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
