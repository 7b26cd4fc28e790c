"""Continuing a drafter lineage across sessions with little state (plans/0008, session 7), on a
tiny random target: a drafter grown to more layers computes exactly what it did before and then
trains its new layers; a light state (no weights, no moments) restores the run from the exported
checkpoint with the loop (step, order, RNGs, curves) intact; a new schedule cycle warms up from
the session's first step; resampling rounds give fresh job ids."""
from __future__ import annotations

import pytest
import torch

from modeling.dflash import DFlashConfig
from training.data import generation_jobs, resample_jobs
from training.state import load_state, save_state
from training.train import (Loop, TrainArgs, evaluate, export_bf16, grow, new_run, restore_run, run_state,
                            train_session)

from test_resume import tiny_data
from test_training import tiny_drafter_config, tiny_target

QUIET = dict(log=lambda *_: None)


def test_grown_drafter_equals_the_shallow_one_then_trains_its_new_layers():
    target = tiny_target()
    data = tiny_data(target)
    c2 = tiny_drafter_config(target)
    args = TrainArgs(budget_s=0, max_steps=1, batch_seqs=3, max_anchors=8, lr=3e-3, warmup_steps=1, plan_steps=4,
                     eval_every=100, eval_seqs=2)
    shallow = new_run("s", c2, "cpu", args=args)
    c3 = DFlashConfig.from_json({**c2.to_json(), "num_hidden_layers": 3})
    deep = new_run("d", c3, "cpu", init_state=grow(shallow.drafter.state_dict(), c3), args=args)
    ids = [0, 1]
    a, b = evaluate(shallow, target, data, ids, args), evaluate(deep, target, data, ids, args)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["tau_hat"] == b["tau_hat"]
    new_o = deep.drafter.layers[2].self_attn.o_proj.weight
    assert not new_o.any() and deep.drafter.layers[2].self_attn.q_proj.weight.any()
    train_session(target, data, [deep], Loop.fresh(0), args, **QUIET)
    assert deep.drafter.layers[2].self_attn.o_proj.weight.any() and deep.drafter.layers[2].mlp.down_proj.weight.any()
    with pytest.raises(ValueError, match="cannot grow"):
        grow({**shallow.drafter.state_dict(), "extra.weight": torch.zeros(1)}, c3)


def test_light_state_restores_from_the_checkpoint_and_a_new_cycle_warms_up(tmp_path):
    target = tiny_target()
    data = tiny_data(target)
    c = tiny_drafter_config(target)
    args = TrainArgs(budget_s=0, max_steps=3, batch_seqs=3, max_anchors=8, lr=3e-3, warmup_steps=2, plan_steps=3,
                     eval_every=100, eval_seqs=2)
    run = new_run("r", c, "cpu", 0.5, "bf16", args=args)
    loop = Loop.fresh(0)
    train_session(target, data, [run], loop, args, tag="a", **QUIET)
    tensors, meta = run_state(run, loop, args, light=True)
    assert set(tensors) == {"loop.gen"}
    save_state(tmp_path / "state", tensors, meta)
    export_bf16(run.drafter, tmp_path / "ckpt")  # bf16 master: the export holds the trained values exactly
    t2, m2 = load_state(tmp_path / "state")
    with pytest.raises(ValueError, match="weights_dir"):
        restore_run(t2, m2, "cpu")
    back, loop2 = restore_run(t2, m2, "cpu", tmp_path / "ckpt")
    for (k, v), v2 in zip(run.drafter.state_dict().items(), back.drafter.state_dict().values()):
        assert torch.equal(v, v2), k
    assert not any(m.any() for m in back.opt.m) and back.opt.t == 0  # moments dropped
    assert (loop2.step, loop2.order, loop2.eval_ids, loop2.rng.getstate()) == \
        (loop.step, loop.order, loop.eval_ids, loop.rng.getstate())
    assert back.curve == run.curve and back.evals == run.evals
    # a new cycle from step 3: warm-up (2 steps) from this step, then the cosine timed to the session
    cyc = TrainArgs(**{**args.__dict__, "max_steps": 4, "plan_steps": 0, "cycle": True, "budget_s": 3600,
                       "timing_warmup": 1, "timing_steps": 1})
    train_session(target, data, [back], loop2, cyc, tag="b", **QUIET)
    lrs = [x[4] for x in back.curve[-4:]]
    assert lrs[:2] == pytest.approx([1.5e-3, 3e-3]) and loop2.plan_start == 3 and loop2.plan_steps > 7
    assert run_state(back, loop2, cyc)[1]["loop"]["plan_start"] == 3


def test_resampling_rounds_append_fresh_job_ids():
    base = generation_jobs(10, 0.4, 0.7, 1.0, 0)
    r1, r2 = resample_jobs(10, 0.7, 1.0, 1), resample_jobs(10, 0.7, 1.0, 2)
    assert sorted(i for i, _ in r1) == list(range(10)) and all(0.7 <= t <= 1.0 for _, t in r1 + r2)
    assert r1 != r2 and r1 == resample_jobs(10, 0.7, 1.0, 1)
    assert [t for _, t in r1] != [t for _, t in base[:10]]  # fresh temperatures, not the base list's greedy 0.0


def test_grown_layers_can_learn_faster_and_keep_their_lr_scale_across_a_resume(tmp_path):
    """With lr_scale 10 on the appended layers their first Adam step is 10× the unscaled one
    (zero-initialised output projections: the gradients agree and weight decay is nil); the
    trained layers move the same; the scale is part of the (light) state."""
    target = tiny_target()
    data = tiny_data(target)
    c2 = tiny_drafter_config(target)
    c3 = DFlashConfig.from_json({**c2.to_json(), "num_hidden_layers": 3})
    init = grow(new_run("s", c2, "cpu").drafter.state_dict(), c3)
    args = TrainArgs(budget_s=0, max_steps=1, batch_seqs=3, max_anchors=8, lr=1e-3, warmup_steps=1, plan_steps=4,
                     eval_every=100, eval_seqs=2)
    runs = [new_run(f"r{f}", c3, "cpu", init_state=init, args=args, lr_scale={"layers.2.": f} if f != 1 else None)
            for f in (1, 10)]
    train_session(target, data, runs, Loop.fresh(0), args, **QUIET)
    one, ten = (r.drafter.layers[2].self_attn.o_proj.weight for r in runs)
    assert one.abs().max() > 0 and torch.allclose(ten, 10 * one, rtol=1e-4, atol=1e-9)
    assert torch.equal(runs[0].drafter.layers[0].mlp.up_proj.weight, runs[1].drafter.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="bf16 master"):  # an fp32 master would come back rounded (breaker 7)
        run_state(runs[1], Loop.fresh(0), args, light=True)
    save_state(tmp_path / "state", *run_state(runs[1], Loop.fresh(0), args))
    back, _ = restore_run(*load_state(tmp_path / "state"), "cpu")
    assert back.lr_scale == {"layers.2.": 10} and back.opt.lr_scales.count(10) == 11
    assert all(torch.equal(a, b) for a, b in zip(back.drafter.parameters(), runs[1].drafter.parameters()))


def test_runs_with_early_anchors_train_in_lock_step_beside_a_uniform_control():
    """A run with anchors weighted toward the response start (``e<W>x<share>``) trains beside a
    uniform one on the same batches: the uniform run's weights are bitwise those of the same run
    trained alone (it draws its anchors first), the early run's differ, and the weighting
    survives the state round trip."""
    from training.device_session import parse_runs

    target = tiny_target()
    data = tiny_data(target)
    c = tiny_drafter_config(target)
    args = TrainArgs(budget_s=0, max_steps=2, batch_seqs=3, max_anchors=4, lr=3e-3, warmup_steps=1, plan_steps=2,
                     eval_every=100, eval_seqs=2)
    alone = new_run("u", c, "cpu", args=args)
    init = {k: v.clone() for k, v in alone.drafter.state_dict().items()}
    train_session(target, data, [alone], Loop.fresh(0), args, **QUIET)
    early = new_run("e", c, "cpu", init_state=init, args=args, early=(2, 0.75))
    uniform = new_run("u", c, "cpu", init_state=init, args=args)
    loop = Loop.fresh(0)
    train_session(target, data, [early, uniform], loop, args, **QUIET)  # the early run listed first
    assert all(torch.equal(a, b) for a, b in zip(alone.drafter.state_dict().values(), uniform.drafter.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(early.drafter.state_dict().values(), uniform.drafter.state_dict().values()))
    back, _ = restore_run(*run_state(early, loop, args), "cpu")
    assert back.early == (2, 0.75) and restore_run(*run_state(uniform, loop, args), "cpu")[0].early is None

    specs = parse_runs("a=L4B8/kl0.5/bf16/shipped;b=L4B8/kl0.5/bf16/shipped/e128x0.5")
    assert [s["early"] for s in specs] == [None, (128, 0.5)]
    assert [s["early"] for s in parse_runs("a=L4B8/kl0/bf16/shipped/e8x.5;b=L4B8/kl0/bf16/shipped/e8x1.")] == [
        (8, 0.5), (8, 1.0)]
    for bad in ("e128", "x0.5", "e128x1.5", "e128x0.5.1", "e128x."):
        with pytest.raises(ValueError, match="anchors field"):
            parse_runs(f"b=L4B8/kl0.5/bf16/shipped/{bad}")


def test_a_run_with_share_or_window_zero_is_a_uniform_run():
    """e<W>x0 or e0x<share> is the uniform draw: such a run takes the uniform runs' anchors
    (loop.gen) and trains bit for bit like them, not on a stream of its own."""
    target = tiny_target()
    data = tiny_data(target)
    c = tiny_drafter_config(target)
    args = TrainArgs(budget_s=0, max_steps=2, batch_seqs=3, max_anchors=4, lr=3e-3, warmup_steps=1, plan_steps=2,
                     eval_every=100, eval_seqs=2)
    init = {k: v.clone() for k, v in new_run("x", c, "cpu", args=args).drafter.state_dict().items()}
    zero = [new_run(n, c, "cpu", init_state=init, args=args, early=e) for n, e in (("z", (128, 0.0)), ("w", (0, 0.5)))]
    uniform = new_run("u", c, "cpu", init_state=init, args=args)
    train_session(target, data, zero + [uniform], Loop.fresh(0), args, **QUIET)
    for z in zero:
        assert all(torch.equal(a, b) for a, b in zip(z.drafter.state_dict().values(), uniform.drafter.state_dict().values()))
    with pytest.raises(ValueError, match="early anchors"):
        new_run("bad", c, "cpu", args=args, early=(8, 1.5))
