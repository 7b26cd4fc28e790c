"""The device entry point end to end on CPU with the real SmolLM2 weights (slow tier,
plans/0008): call 1 generates a shard from a small prompt file and trains the shipped drafter
two steps; call 2 resumes from the work directory, trains two more (training responses cut at loops); the state round-trips
bitwise, the step, data order and held-out τ̂ curve continue (appended, not restarted). $OUT
holds no more than one device call returns; the remaining state parts come from
work/state-final (the follow-up call)."""
from __future__ import annotations

import json

import pytest
import torch

from training.device_session import RETURN_BYTES, RETURN_FILES, main
from training.state import load_state
from training.store import load_shards, save_prompts, shard_paths
from training.train import TrainArgs, restore_run, run_state

pytestmark = pytest.mark.slow

RUN = ["--runs", "a=L4B8/kl0.5/fp32/shipped", "--batch-seqs", "2", "--max-anchors", "4", "--eval-seqs", "1",
       "--max-steps", "2", "--train-minutes", "5"]


def fetch_rest(out, work):
    """What the follow-up device call does: copy the parts $OUT could not hold."""
    files = list(out.iterdir())
    assert len(files) <= RETURN_FILES and sum(f.stat().st_size for f in files) <= RETURN_BYTES
    for p in (work / "state-final").glob("state.part*"):
        if not (out / p.name).exists():
            (out / p.name).write_bytes(p.read_bytes())


def test_generate_train_resume(tmp_path, tokenizer):
    texts = [("sharegpt", True, "Give me three tips for writing clear emails."),
             ("sharegpt", True, "What is the difference between a list and a tuple?"),
             ("code_fn", False, 'import os\n\ndef count_lines(path):\n    """Number of lines in the file."""\n'),
             ("code_instruct", True, "Write a Python function `chunks(xs, n)` that splits xs into lists of n.")]
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]) if chat else t)
           for _, chat, t in texts]
    prompts = tmp_path / "prompts.npz"
    save_prompts(prompts, ids, [k for k, _, _ in texts], {"test": True})
    work, out1, out2 = tmp_path / "work", tmp_path / "o1", tmp_path / "o2"

    main(["--out", str(out1), "--work", str(work), "--prompts", str(prompts), "--gen-minutes", "5",
          "--gen-batch", "8", "--max-new", "12", *RUN])
    shards = shard_paths([out1])
    assert len(shards) == 1 and shards[0].name == shard_paths([work / "data"])[0].name
    data = load_shards(shards)
    assert len(data["tokens"]) == 7  # 4 greedy + 3 sampled (share 0.4)
    for seq, pl, j in zip(data["tokens"], data["prompt_lens"], data["job_ids"]):
        assert 0 < len(seq) - pl <= 12
    fetch_rest(out1, work)
    s1 = json.loads((out1 / "state.json").read_text())
    assert s1["session"]["generation"]["remaining"] == 0
    t1, m1 = load_state(out1)
    run, loop = restore_run(t1, m1, "cpu")
    t1b, m1b = run_state(run, loop, TrainArgs(**m1["args"]))
    assert t1b.keys() == t1.keys() and all(torch.equal(t1b[k], t1[k]) for k in t1)  # restored exactly
    assert m1b["loop"] == m1["loop"] and m1["loop"]["step"] == 2
    from training.heldout import load as load_heldout, prompt_key  # the export carries its held-out prompts
    assert load_heldout(work / "export") == {prompt_key(t, p) for t, p, j in zip(
        data["tokens"], data["prompt_lens"], data["job_ids"]) if j in m1["loop"]["eval_ids"]} != set()

    # call 2 shares the device call with another command: at most 3 files of its own; the schedule is
    # re-fit to end with this session (--replan: plan re-timed, so 0 until timing_steps)
    main(["--out", str(out2), "--work", str(work), "--prompts", str(prompts), "--trim-loops", "4", "--replan",
          "--return-files", "3", "--eval-every", "1", *RUN])
    assert len(list(out2.iterdir())) == 3
    fetch_rest(out2, work)
    t2, m2 = load_state(out2)
    assert m2["loop"]["step"] == 4 and [e["step"] for e in m2["evals"]] == [0, 2, 3, 4]  # --eval-every 1 on resume
    assert m2["args"]["plan_s"] == 0.0 and m2["args"]["eval_every"] == 1
    assert m2["evals"][:2] == m1["evals"] and [list(c) for c in m2["curve"][:2]] == [list(c) for c in m1["curve"]]
    assert len(m2["sessions"]) == 2 and m2["sessions"][1]["start_step"] == 2
    # the data order continued: call 2 first drew the two ids call 1 left in its second epoch, then began a
    # third; the held-out greedy answer and every other answer to its prompt (here all three sampled ones)
    # are in no epoch — 3 training sequences of 7
    from training.train import training_ids
    train = training_ids(data, m1["loop"]["eval_ids"])
    assert len(train) == 3 and set(m1["loop"]["order"]) | set(m2["loop"]["order"]) <= set(train)
    assert len(m1["loop"]["order"]) == 2 and m1["loop"]["epoch"] == 2 and m2["loop"]["epoch"] == 3
    assert not torch.equal(t2["w.fc.weight"], t1["w.fc.weight"])
