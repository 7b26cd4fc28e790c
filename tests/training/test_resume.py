"""Sharded, resumable data generation and training that resumes bit for bit (plans/0008), on
a tiny random target: shards round-trip, generation skips the jobs a shard holds, a run saved
to parts and restored continues exactly like an uninterrupted one (fp32 master + hard labels,
bf16 master + KL), the τ̂ curve is appended, damaged parts are refused, stochastic rounding is
unbiased, the KL loss vanishes when the drafter equals the target, code prompts keep licences."""
from __future__ import annotations

import random
import zipfile

import numpy as np
import pytest
import torch

from training.batched import generate
from training.data import generate_shards, generation_jobs
from training.optim import stochastic_round_bf16
from training.recipe import chunked_loss_backward
from training.sources import file_prompts, wheel_info
from training.state import load_state, save_state
from training.store import done_jobs, load_shards, save_shard, shard_paths
from training.train import Loop, TrainArgs, new_run, restore_run, run_state, train_session

from test_training import tiny_drafter_config, tiny_target


def tiny_data(target, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 48, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    temps = [0.0] * (n - 4) + [0.8] * 4
    outs = generate(target, prompts, 12, torch.tensor(temps), (0,), g)
    return {"tokens": [torch.tensor(p + o, dtype=torch.int32) for p, o in zip(prompts, outs)],
            "prompt_lens": [len(p) for p in prompts], "temps": temps, "job_ids": list(range(100, 100 + n))}


def test_shard_round_trip_and_done_jobs(tmp_path):
    seqs = [[1, 2, 3, 65535], [7, 8]]
    save_shard(tmp_path / "shard-a-000.npz", seqs, [2, 1], [0.0, 0.9], [5, 9], {"x": 1})
    save_shard(tmp_path / "shard-b-000.npz", [[4, 4, 4]], [1], [0.0], [5], {})  # job 5 again: first copy wins
    paths = shard_paths([tmp_path, None])
    d = load_shards(paths)
    assert [t.tolist() for t in d["tokens"]] == seqs and d["job_ids"] == [5, 9]
    assert d["prompt_lens"] == [2, 1] and d["temps"] == pytest.approx([0.0, 0.9])
    assert done_jobs(paths) == {5, 9}
    with pytest.raises(ValueError, match="uint16"):
        save_shard(tmp_path / "shard-c-000.npz", [[70000]], [1], [0.0], [1], {})


def test_generation_resumes_where_the_shards_stop(tmp_path):
    target = tiny_target()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 48, (n,), generator=g).tolist() for n in (3, 5, 4, 6, 5, 3)]
    jobs = generation_jobs(len(prompts), 0.25, 0.7, 1.0, seed=0)
    first = generate_shards(target, prompts, jobs, set(), tmp_path, "s1", (0,), batch=2, max_new_tokens=6,
                            budget_s=1e-9, log=lambda *_: None)  # the budget stops it after one batch
    assert first["jobs"] == 2 and first["remaining"] == len(jobs) - 2
    done = done_jobs(shard_paths([tmp_path]))
    second = generate_shards(target, prompts, jobs, done, tmp_path, "s2", (0,), batch=2, max_new_tokens=6,
                             log=lambda *_: None, shard_bytes=40)  # tiny shards: several files
    assert second["remaining"] == 0 and len(second["shards"]) > 1
    data = load_shards(shard_paths([tmp_path]))
    assert sorted(data["job_ids"]) == list(range(len(jobs)))
    for j, seq, pl in zip(data["job_ids"], data["tokens"], data["prompt_lens"]):
        p, t = prompts[jobs[j][0]], jobs[j][1]
        assert seq[:pl].tolist() == p
        if t == 0.0:  # greedy jobs equal a fresh one-row greedy decode
            assert seq[pl:].tolist() == generate(target, [p], 6, torch.zeros(1), (0,))[0]


@pytest.mark.parametrize("master,kl", [("fp32", 0.0), ("bf16", 0.5)])
def test_resumed_training_equals_uninterrupted(tmp_path, master, kl):
    target = tiny_target()
    data = tiny_data(target)
    c = tiny_drafter_config(target)
    args = TrainArgs(budget_s=0, max_steps=6, batch_seqs=3, max_anchors=8, lr=3e-3, warmup_steps=2, plan_steps=6,
                     eval_every=4, eval_seqs=2)
    quiet = dict(log=lambda *_: None)

    straight = new_run("r", c, "cpu", kl, master, args=args)
    loop = Loop.fresh(0)
    train_session(target, data, [straight], loop, args, tag="one", **quiet)

    half = TrainArgs(**{**args.__dict__, "max_steps": 3})
    first = new_run("r", c, "cpu", kl, master, args=args)
    loop1 = Loop.fresh(0)
    train_session(target, data, [first], loop1, half, tag="a", **quiet)
    tensors, meta = run_state(first, loop1, half)
    save_state(tmp_path, tensors, meta, part_bytes=20_000)  # several parts
    assert len(list(tmp_path.glob("state.part*"))) > 1
    t2, m2 = load_state(tmp_path)
    assert all(torch.equal(t2[k], v.cpu()) for k, v in tensors.items())
    resumed, loop2 = restore_run(t2, m2, "cpu")
    assert resumed.drafter.layers[0].mlp.up_proj.weight.dtype == (torch.bfloat16 if master == "bf16" else torch.float32)
    train_session(target, data, [resumed], loop2, half, tag="b", **quiet)

    for (k, v), (k2, v2) in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        assert torch.equal(v, v2), k
    assert all(torch.equal(a, b) for a, b in zip(straight.opt.m + straight.opt.v, resumed.opt.m + resumed.opt.v))
    assert straight.curve == resumed.curve and loop.order == loop2.order and loop.step == loop2.step == 6
    # the held-out curve: session a (steps 0, 3), then b appended (step 4, 6); same values as straight
    assert [e["step"] for e in resumed.evals] == [0, 3, 4, 6] and [s["tag"] for s in resumed.sessions] == ["a", "b"]
    want = {e["step"]: e["tau_hat"] for e in straight.evals}
    assert all(e["tau_hat"] == want[e["step"]] for e in resumed.evals if e["step"] in want)


def test_damaged_or_missing_part_is_refused(tmp_path):
    save_state(tmp_path, {"w": torch.arange(10000, dtype=torch.float32)}, {"a": 1}, part_bytes=8192)
    part = sorted(tmp_path.glob("state.part*"))[1]
    blob = bytearray(part.read_bytes())
    blob[7] ^= 1
    part.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=part.name):
        load_state(tmp_path)
    part.unlink()
    with pytest.raises(FileNotFoundError, match=part.name):
        load_state(tmp_path)


def test_stochastic_rounding_is_unbiased_between_neighbours():
    x = torch.full((200_000,), 1.0 + 2 ** -9)  # a quarter of the way from 1.0 to the next bf16 (1 + 2^-7)
    r = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(float(r.mean()) - (1.0 + 2 ** -9)) < 2e-5
    exact = torch.tensor([0.5, -3.0, 1.0 + 2 ** -7])
    assert torch.equal(stochastic_round_bf16(exact, None).float(), exact)


def test_kl_loss_vanishes_for_the_target_itself_and_matches_direct():
    torch.manual_seed(0)
    head = torch.randn(40, 8)
    h = torch.randn(10, 8, requires_grad=True)
    labels = torch.randint(0, 40, (10,))
    w = torch.rand(10)
    zero, _ = chunked_loss_backward(h, labels, w, head, chunk=3, backward=False, teacher=h.detach(), kl=1.0)
    assert abs(zero) < 1e-6
    teacher = torch.randn(10, 8)
    loss, _ = chunked_loss_backward(h, labels, w, head, chunk=4, teacher=teacher, kl=0.3)
    h2 = h.detach().clone().requires_grad_(True)
    p = torch.softmax(teacher @ head.T, -1)
    logq = torch.log_softmax(h2 @ head.T, -1)
    ce = torch.nn.functional.cross_entropy(h2 @ head.T, labels, reduction="none")
    ref = ((0.7 * ce + 0.3 * (p * (p.log() - logq)).sum(-1)) * w).sum() / w.sum()
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-6)


def test_code_prompts_and_licence_check(tmp_path):
    src = ('import os\n\n\ndef walk_sizes(root):\n    """Total size of the files under root.\n\n    More.\n    """\n'
           '    total = 0\n    for d, _, fs in os.walk(root):\n        for f in fs:\n'
           '            total += os.path.getsize(os.path.join(d, f))\n    return total\n')
    ps = file_prompts(src, "pkg==1:mod.py", random.Random(0))
    fn = next(p for p in ps if p.kind == "code_fn")
    assert fn.text == 'import os\n\ndef walk_sizes(root):\n    """Total size of the files under root.\n\n    More.\n    """\n'
    assert not fn.chat and next(p for p in ps if p.kind == "code_instruct").chat
    for lic, ok in (("MIT", True), ("GPL-3.0-only", False)):
        whl = tmp_path / f"p_{ok}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr("p-1.0.dist-info/METADATA", f"Metadata-Version: 2.4\nName: p\nVersion: 1.0\nLicense-Expression: {lic}\n")
        if ok:
            assert wheel_info(whl)["license"] == "MIT"
        else:
            with pytest.raises(ValueError, match="not in the permissive list"):
                wheel_info(whl)
    assert np.dtype(np.uint16).itemsize == 2


def test_batched_decoder_equals_plain_greedy_with_compaction():
    """training.batched.generate (chunked prefill, grouped decode attention, finished rows
    dropped every 2 steps) == step-by-step greedy through LlamaModel.forward."""
    from modeling.llama import causal_mask

    m = tiny_target()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 48, (n,), generator=g).tolist() for n in (3, 7, 5, 9, 2, 6)]
    eos = (5, 7, 11)

    def plain(p):
        seq = list(p)
        for _ in range(20):
            s = torch.tensor(seq)
            h, _ = m(s, torch.arange(len(s)), m.new_cache(len(s)), causal_mask(0, len(s)))
            seq.append(int(m.logits(h[-1:]).argmax(-1)))
            if seq[-1] in eos:
                break
        return seq[len(p):]

    got = generate(m, prompts, 20, torch.zeros(len(prompts)), eos, g, prefill_rows=4, compact_every=2)
    want = [plain(p) for p in prompts]
    assert got == want and len({len(x) for x in want}) > 2  # rows finish at different steps


def test_trim_loops_cuts_the_third_repeat_and_keeps_the_prompt():
    from training.data import trim_loops

    prompt = [9, 9, 9, 9, 9, 9]  # a repetitive prompt is never cut
    body = [1, 2, 3, 4, 5, 6, 7, 8]
    seq = torch.tensor(prompt + [20, 21] + body * 5)
    out = trim_loops(seq, len(prompt), n=4, repeats=2)
    # [1,2,3,4] starts at response offsets 2, 10, 18: the third one is the cut
    assert out.tolist() == prompt + [20, 21] + body * 2
    fresh = torch.tensor(prompt + list(range(30, 60)))
    assert torch.equal(trim_loops(fresh, len(prompt), n=4), fresh)
    same = torch.tensor(prompt + [7] * 20)  # a one-token loop keeps n response tokens
    assert trim_loops(same, len(prompt), n=4).tolist() == prompt + [7] * 4


def test_eval_on_the_first_response_tokens_equals_eval_on_cut_sequences():
    from training.train import evaluate

    target = tiny_target()
    data = tiny_data(target)
    run = new_run("r", tiny_drafter_config(target), "cpu", args=TrainArgs())
    args, ids = TrainArgs(batch_seqs=3, max_anchors=8), [0, 1, 2, 3, 4]
    cut = {**data, "tokens": [t[:p + 4 + 1] for t, p in zip(data["tokens"], data["prompt_lens"])]}
    first, whole = evaluate(run, target, data, ids, args, first=4), evaluate(run, target, cut, ids, args)
    assert first["tau_hat"] == whole["tau_hat"] and first["p_accept_ge"] == whole["p_accept_ge"]
    assert first["loss"] == pytest.approx(whole["loss"], abs=1e-3)
    assert evaluate(run, target, data, ids, args)["p_accept_ge"] != first["p_accept_ge"]  # the cut matters


def test_replan_times_after_warmup_at_the_previous_lr_and_lr_overrides_on_resume():
    """A re-plan (training.device_session --replan) of a state at the cosine floor: the timing
    steps keep the stored schedule's lr (the floor, with the stored peak) instead of jumping
    to the peak; the new plan starts after them; ``--lr`` sets the resumed run's peak, and
    without it the stored peak stays (plans/0008, session 4's timing mistake)."""
    from training.device_session import build_parser, resume_args
    from training.train import lr_at

    target = tiny_target()
    data = tiny_data(target)
    args = TrainArgs(budget_s=0, max_steps=6, batch_seqs=3, max_anchors=8, lr=3e-3, warmup_steps=1, plan_steps=4,
                     eval_every=100, eval_seqs=2)
    run, loop = new_run("r", tiny_drafter_config(target), "cpu", args=args), Loop.fresh(0)
    train_session(target, data, [run], loop, args, log=lambda *_: None)
    assert run.curve[-1][4] == pytest.approx(3e-4)  # past the 4-step plan: at the floor (0.1 x peak)
    tensors, meta = run_state(run, loop, args)

    kept = resume_args(meta["args"], loop.step, loop.plan_steps, build_parser().parse_args(["--out", "o"]))
    assert kept.lr == 3e-3 and not kept.replan

    new = resume_args(meta["args"], loop.step, loop.plan_steps,
                      build_parser().parse_args(["--out", "o", "--replan", "--lr", "1e-3"]))
    assert new.lr == 1e-3 and new.replan and new.replan_lr == pytest.approx(3e-4)
    new.budget_s, new.max_steps, new.timing_warmup, new.timing_steps = 600.0, 6, 1, 2
    run2, loop2 = restore_run(tensors, meta, "cpu")
    train_session(target, data, [run2], loop2, new, log=lambda *_: None)
    lrs = {c[0]: c[4] for c in run2.curve}
    assert [lrs[s] for s in (6, 7, 8)] == pytest.approx([3e-4] * 3)  # warm-up + timing window: the old floor
    assert loop2.plan_steps > 9 and loop2.step == 12
    for s in (9, 10, 11):  # the new cosine with the new peak
        assert lrs[s] == pytest.approx(lr_at(s, loop2.plan_steps, 1, 1e-3, 0.1), rel=1e-5) and lrs[s] > 3e-4
