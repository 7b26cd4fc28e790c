"""One device call of drafter training (plans/0008): generate a data shard and/or continue
training within a wall-clock budget, and write everything needed to resume into --out.

  python3 -m training.device_session --out $OUT --minutes 9 --gguf $SPECDEC_GGUF \\
      --prompts .devcarry/h4/prompts.npz --gen-minutes 4                      # call A: data
  python3 -m training.device_session --out $OUT --minutes 9 --gguf $SPECDEC_GGUF \\
      --train-minutes 6.5 --runs 'hard=L4B8/kl0/fp32/shipped' --accept-n 10     # call B: train

Work directory (--work, default /tmp/specdec/h4; survives between back-to-back calls):
``data/shard-*.npz`` (generated here or copied from --data dirs), ``state/`` (the training
state of the continued run: ``state.json`` + parts), ``export/`` (its bf16 checkpoint).
Training resumes from ``--resume`` (a carried state dir) or ``work/state``; otherwise it
starts the ``--runs`` (lock-step) from the shipped drafter or from scratch.

Files written to --out (≤ 8 files, each ≤ 16 MiB, ≤ 63 MiB together): the new shards
(generation) and ``state.json`` + as many ``state.partNNN`` of the best run as fit (training;
the whole state is in ``work/state-final``, and the log names the parts to fetch with a
follow-up call: a 4-layer bf16-master state is 6 parts, ~87 MiB, so two calls); a summary goes
to ``session.json`` when no state is written, else into ``state.json`` under "session".
When another command shares the device call, ``--return-files`` / ``--return-mib`` leave it room.
The state is in --out before the acceptance bench starts (a bench that overruns costs only the
table, which is added to ``state.json`` when it finishes).

A resumed run keeps its schedule and stored peak lr unless told: ``--lr`` sets a new peak;
``--replan`` re-times the cosine from this session's steps 10-40 (evaluations excluded) to
reach its floor (``min_lr_frac``·peak) when this session's budget ends, so the weights that
come back are annealed (the ones to ship). Until the new plan exists the steps run at the lr
the stored schedule gives next (not the peak). A later session continuing past the plan stays
at the floor unless it re-plans again.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import shutil
import time

import torch

T_START = time.time()
RETURN_FILES, RETURN_BYTES = 8, 64 * 2 ** 20 - 2 ** 20  # what one device call returns from $OUT (with a margin)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T_START:.0f}s] {msg}", flush=True)


def parse_runs(spec: str) -> list[dict]:
    """'name=L4B8/kl0.5/fp32/shipped;other=L6B16/kl0/bf16/scratch' → run specs. Fields after
    the architecture are optional: kl (default 0), master fp32|bf16 (default fp32), init
    shipped|scratch|grow|<checkpoint dir> (default shipped; grow: the shipped drafter with
    zero-output layers appended up to the run's layer count, ``training.train.grow``), anchors
    e<W>x<share> (e.g. e128x0.5: half the anchors in the first 128 response tokens,
    ``recipe.sample_anchors``; default uniform). ValueError for a malformed anchors field."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        name, rest = item.split("=", 1)
        f = rest.split("/")
        layers, block = f[0][1:].split("B")
        early = None
        if len(f) > 4:
            m = re.fullmatch(r"e(\d+)x(\d+\.?\d*|\.\d+)", f[4])
            if not m or not 0 <= float(m[2]) <= 1:
                raise ValueError(f"run {name}: anchors field {f[4]!r} is not e<W>x<share> with 0 <= share <= 1")
            early = (int(m[1]), float(m[2]))
        out.append({"name": name, "layers": int(layers), "block": int(block),
                    "kl": float(f[1][2:]) if len(f) > 1 else 0.0, "master": f[2] if len(f) > 2 else "fp32",
                    "init": f[3] if len(f) > 3 else "shipped", "early": early})
    return out


def _inherited_heldout(specs) -> set[str]:
    """The held-out prompt keys stored with the checkpoints the runs start from (``training.heldout``)."""
    from modeling.defaults import DEFAULT_DRAFTER_DIR
    from training.heldout import load

    return set().union(*(load(DEFAULT_DRAFTER_DIR if s["init"] in ("shipped", "grow") else s["init"])
                         for s in specs if s["init"] != "scratch"))


def _fresh_runs(specs, target, device, args, grow_lr_scale: float = 1.0):
    from modeling.defaults import DEFAULT_DRAFTER_DIR, drafter_config
    from modeling.dflash import DFlashConfig, DFlashDrafter
    from training.train import grow, new_run

    runs = []
    for s in specs:
        init, lr_scale = None, None
        if s["init"] != "scratch":
            src = DEFAULT_DRAFTER_DIR if s["init"] in ("shipped", "grow") else pathlib.Path(s["init"])
            d = DFlashDrafter.load(src)
            c = d.config
            init = d.state_dict()
            if s["init"] == "grow" and c.block_size == s["block"] and c.num_hidden_layers < s["layers"]:
                lr_scale = {f"layers.{i}.": grow_lr_scale for i in range(c.num_hidden_layers, s["layers"])}
                c = DFlashConfig.from_json({**c.to_json(), "num_hidden_layers": s["layers"]})
                init = grow(init, c, args.seed)
            if (c.num_hidden_layers, c.block_size) != (s["layers"], s["block"]):
                raise SystemExit(f"run {s['name']}: init {src} is L{c.num_hidden_layers}B{c.block_size}, "
                                 f"not L{s['layers']}B{s['block']}")
        else:
            c = drafter_config(target.cfg, fresh=True, num_layers=s["layers"], num_taps=3, block_size=s["block"])
        runs.append(new_run(s["name"], c, device, s["kl"], s["master"], init, args,
                            lr_scale if grow_lr_scale != 1.0 else None, s.get("early")))
    return runs


def continue_lineage(runs, loop, meta: dict) -> None:
    """Fresh ``runs`` (weights = the lineage's checkpoint, grown or not; fresh moments) carry on
    the lineage whose training state meta is ``meta`` (``state.json["meta"]``): its global step
    and held-out job ids (so τ̂ stays comparable), its curves, evaluations and sessions. The data
    order starts afresh (this session's data differs); ``loop.epoch`` keeps counting."""
    lp = meta["loop"]
    loop.step, loop.epoch, loop.eval_ids = lp["step"], lp["epoch"], list(lp["eval_ids"])
    for r in runs:
        r.curve = [tuple(x) for x in meta["curve"]]
        r.evals = [{**e, "inherited": True} for e in meta["evals"]]
        r.sessions = [dict(x) for x in meta["sessions"]]


def resume_args(stored: dict, step: int, plan_steps: int, a: argparse.Namespace):
    """TrainArgs for a resumed run: the stored ones (``meta["args"]``) with this call's
    overrides: ``--lr`` (a new peak, when given), ``--eval-every`` (when given), ``--replan``
    (the schedule re-timed this session; until then the lr the stored schedule gives at
    ``step`` with the stored peak). ``step``/``plan_steps``: the restored loop's."""
    from training.train import TrainArgs, lr_at

    old = TrainArgs(**stored)
    args = TrainArgs(**{**stored, "replan": False, "replan_lr": 0.0})
    args.lr = a.lr if a.lr is not None else old.lr
    args.eval_every = a.eval_every or old.eval_every
    if a.replan:  # plan_s 0: the budget left after timing; plan_steps 0: not a fixed length
        args.replan, args.plan_s, args.plan_steps = True, 0.0, 0
        args.replan_lr = lr_at(step, plan_steps or 10 ** 9, old.warmup_steps, old.lr, old.min_lr_frac)
    return args


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m training.device_session")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/specdec/h4")
    ap.add_argument("--minutes", type=float, default=9.0, help="wall budget of the whole command")
    ap.add_argument("--gguf", default="")
    ap.add_argument("--prompts", default=".devcarry/h4/prompts.npz")
    ap.add_argument("--data", default="", help="comma-separated dirs of carried shards")
    ap.add_argument("--gen-minutes", type=float, default=0.0)
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument("--max-new", type=int, default=640)
    ap.add_argument("--sampled-share", type=float, default=0.4)
    ap.add_argument("--gen-seed", type=int, default=0)
    ap.add_argument("--train-minutes", type=float, default=0.0)
    ap.add_argument("--max-steps", type=int, default=0, help="stop training after this many steps (tests)")
    ap.add_argument("--runs", default="hard=L4B8/kl0/fp32/shipped",
                    help="NAME=L<layers>B<block>[/kl<w>[/fp32|bf16[/shipped|scratch|grow|DIR[/e<W>x<share>]]]];… "
                         "(parse_runs); runs train in lock-step on the same batches")
    ap.add_argument("--resume", default="", help="a carried state dir to continue (else work/state if present)")
    ap.add_argument("--resume-weights", default="", help="checkpoint dir holding the weights of a light --resume state")
    ap.add_argument("--lineage", default="", help="state.json of the run the --runs continue (fresh moments): its "
                    "global step, held-out ids, curves, evaluations and sessions carry on")
    ap.add_argument("--cycle", action="store_true", help="start a new schedule cycle this session: warm-up "
                    "(--warmup-steps) to the peak --lr, then a cosine to its floor timed to end with the budget")
    ap.add_argument("--grow-lr-scale", type=float, default=1.0, help="lr multiplier of the layers a 'grow' run "
                    "appends (session 7: at 1, zero-initialised layers stayed near zero for 1,068 steps)")
    ap.add_argument("--timing-warmup", type=int, default=10)
    ap.add_argument("--timing-steps", type=int, default=30)
    ap.add_argument("--light-state", action="store_true", help="return the best run as its bf16 checkpoint "
                    "(--out/ckpt) + a light state (--out/state: no weights, no moments) instead of the full state")
    ap.add_argument("--gen-rounds", type=int, default=0, help="append this many resampling rounds to the job "
                    "list (each: every prompt once, sampled, T ~ U[0.7, 1.0], seeded by its round number)")
    ap.add_argument("--gen-skip-base", action="store_true", help="generate only the resampling rounds' jobs "
                    "(the base job list is done in shards not carried here)")
    ap.add_argument("--plan-minutes", type=float, default=60.0, help="planned training minutes over all sessions")
    ap.add_argument("--batch-seqs", type=int, default=16)
    ap.add_argument("--max-anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None, help="peak lr (default 8e-4; a resumed run keeps its "
                    "stored peak unless given)")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=None, help="held-out evaluation every N steps (default "
                    "1000; a resumed run keeps its own unless given)")
    ap.add_argument("--eval-seqs", type=int, default=128)
    ap.add_argument("--trim-loops", type=int, default=0, help="cut training responses where an n-gram of this "
                    "size repeats a third time (0: off; applies to resumed runs too)")
    ap.add_argument("--replan", action="store_true", help="resumed run: re-fit the cosine schedule to end with "
                    "this session's training budget (decay now; the trained weights are the ones to ship)")
    ap.add_argument("--return-files", type=int, default=RETURN_FILES, help="files this command may leave in --out "
                    "(less when another command shares the device call)")
    ap.add_argument("--return-mib", type=float, default=RETURN_BYTES / 2 ** 20, help="MiB this command may leave in --out")
    ap.add_argument("--accept-n", type=int, default=0, help="acceptance prompts per set (0: no acceptance bench)")
    ap.add_argument("--accept-max-new", type=int, default=128)
    ap.add_argument("--reserve", type=float, default=None, help="seconds kept after training for saving, export "
                    "and the acceptance bench (default 40 + 3.2 per prompt and mode; session 5 used ~10 of its 91)")
    ap.add_argument("--accept-modes", default="chain,tree@64")
    ap.add_argument("--tag", default=time.strftime("%Y%m%d%H%M%S"))
    return ap


def main(argv=None) -> None:
    global T_START
    T_START = time.time()  # --minutes counts from this call (not from the import: a test or a caller may import early)
    ap = build_parser()
    a = ap.parse_args(argv)
    from training.state import has_state

    fresh = not (a.resume or has_state(pathlib.Path(a.work) / "state"))  # else the runs come from the state
    if a.light_state and fresh and not all(s["master"] == "bf16" for s in parse_runs(a.runs)):  # before device time
        ap.error("--light-state needs bf16-master runs (NAME=ARCH/klX/bf16/...): an fp32 master's bf16 checkpoint "
                 "would round its weights")

    from modeling.llama import LlamaModel
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import default_gguf_path, load_target
    from training.store import done_jobs, load_prompts, load_shards, shard_paths

    deadline = T_START + a.minutes * 60
    out, work = pathlib.Path(a.out), pathlib.Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    (work / "data").mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gguf = a.gguf or None
    cfg, state = load_target(gguf)
    target = LlamaModel.from_state_dict(cfg, state, dev, dt).eval().requires_grad_(False)
    del state
    tok = TextTokenizer.from_file(gguf or default_gguf_path())
    _log(f"target loaded on {dev} {dt}")
    session = {"tag": a.tag, "argv": vars(a), "device": torch.cuda.get_device_name() if cuda else "cpu"}
    written: list[pathlib.Path] = []

    for d in filter(None, a.data.split(",")):  # carried shards join the work dir
        for p in shard_paths([d]):
            if not (work / "data" / p.name).exists():
                shutil.copy(p, work / "data" / p.name)

    if a.gen_minutes > 0:
        from training.data import generate_shards, generation_jobs, resample_jobs

        prompts, kinds, pmeta = load_prompts(a.prompts)
        jobs = generation_jobs(len(prompts), a.sampled_share, 0.7, 1.0, a.gen_seed)
        base = len(jobs)
        jobs += [j for r in range(1, a.gen_rounds + 1) for j in resample_jobs(len(prompts), 0.7, 1.0, r)]
        done = done_jobs(shard_paths([work / "data"]))
        if a.gen_skip_base:
            done |= set(range(base))
        budget = min(a.gen_minutes * 60, deadline - time.time() - 30)
        _log(f"generation: {len(jobs)} jobs, {len(done)} done before, budget {budget:.0f}s")
        g = generate_shards(target, prompts, jobs, done, work / "data", a.tag, tuple(tok.eos_token_ids),
                            a.gen_batch, a.max_new, budget, a.gen_seed, _log)
        for p in g["shards"]:
            shutil.copy(p, out / pathlib.Path(p).name)
            written.append(out / pathlib.Path(p).name)
        session["generation"] = {**g, "jobs_total": len(jobs), "done_before": len(done), "prompt_kinds":
                                 {k: kinds.count(k) for k in set(kinds)}, "max_new_tokens": a.max_new,
                                 "sampled_share": a.sampled_share, "generator": "training.batched.generate bf16"}

    if a.train_minutes > 0:
        from training.state import PART_BYTES, load_state, save_state
        from training.train import Loop, TrainArgs, export_bf16, restore_run, run_state, train_session

        data = load_shards(shard_paths([work / "data"]))
        _log(f"training data: {len(data['tokens'])} sequences, "
             f"{sum(len(t) for t in data['tokens'])} tokens from {len(shard_paths([work / 'data']))} shards")
        args = TrainArgs(batch_seqs=a.batch_seqs, max_anchors=a.max_anchors, lr=8e-4 if a.lr is None else a.lr,
                         warmup_steps=a.warmup_steps,
                         plan_s=a.plan_minutes * 60, eval_every=a.eval_every or 1000, eval_seqs=a.eval_seqs)
        resume = a.resume or (str(work / "state") if has_state(work / "state") else "")
        if resume:
            tensors, meta = load_state(resume)
            run, loop = restore_run(tensors, meta, dev, a.resume_weights or None)
            args = resume_args(meta["args"], loop.step, loop.plan_steps, a)
            runs = [run]
            _log(f"resumed {run.name} at step {loop.step} (plan {loop.plan_steps}, peak lr {args.lr:g}"
                 f"{f', timing steps at lr {args.replan_lr:g}' if a.replan else ''}) from {resume}")
        else:
            runs = _fresh_runs(parse_runs(a.runs), target, dev, args, a.grow_lr_scale)
            loop = Loop.fresh(args.seed)
            args.heldout_prompts = tuple(sorted(_inherited_heldout(parse_runs(a.runs))))
            if a.lineage:
                continue_lineage(runs, loop, json.loads(pathlib.Path(a.lineage).read_text())["meta"])
                _log(f"runs {[r.name for r in runs]} continue the lineage of {a.lineage} at step {loop.step} "
                     f"({len(loop.eval_ids)} held-out ids, {len(runs[0].evals)} evaluations), fresh moments")
        args.cycle = a.cycle
        args.timing_warmup, args.timing_steps = a.timing_warmup, a.timing_steps
        # saving + export ~40 s; acceptance ~0.8 s per prompt-run on the H200 (2 sets, 2 drafters)
        reserve = a.reserve if a.reserve is not None else 40 + 0.8 * a.accept_n * 2 * 2 * len(a.accept_modes.split(","))
        args.trim_loops = a.trim_loops
        args.budget_s = max(30.0, min(a.train_minutes * 60, deadline - time.time() - reserve))
        args.max_steps = a.max_steps
        if (a.replan or a.cycle) and not resume:  # a fresh run is timed anyway; the plan ends with this session's budget
            args.replan, args.plan_s, args.plan_steps = a.replan, 0.0, 0
        if a.cycle:
            args.plan_s, args.plan_steps = 0.0, 0
        _log(f"training budget {args.budget_s:.0f}s (reserve {reserve:.0f}s){' replan' if a.replan else ''}")
        train_session(target, data, runs, loop, args, _log, a.tag)
        # the best run by final τ̂ on the first 64 response tokens (tracks the bench; plans/0008,
        # session 3); without --light-state among those whose state fits the files the link returns
        # (a 4-layer fp32-master state needs 8 parts: it stays in work/state-<name>)
        score = lambda r: r.evals[-1].get("tau_hat_first64", r.evals[-1]["tau_hat"])  # noqa: E731 — the bench's regime
        exports = {r.name: work / f"export-{r.name}" for r in runs}
        from training.train import heldout_prompts

        held = heldout_prompts(data, loop.eval_ids) | set(args.heldout_prompts)  # travels with each export
        if a.light_state:  # every run exported and kept here; the best one's checkpoint + light state return
            best = max(runs, key=score)
            for r in runs:
                export_bf16(r.drafter, exports[r.name], held)
                save_state(work / f"state-{r.name}", *run_state(r, loop, args, light=True))
        else:
            room = a.return_files - len(written) - 1
            fits = [r for r in runs if math.ceil(sum(t.nbytes for t in run_state(r, loop, args)[0].values())
                                                 / PART_BYTES) <= room] or runs
            best = max(fits, key=score)
            for r in runs:  # every run's state stays on the machine; the best one travels back
                tensors, meta = run_state(r, loop, args)
                save_state(work / ("state" if r is best else f"state-{r.name}"), tensors, meta)
            exports = {best.name: work / "export"}
            export_bf16(best.drafter, exports[best.name], held)
        session["training"] = {"best": best.name, "best_overall": max(runs, key=score).name,
                               "runs": {r.name: {"kl": r.kl, "master": r.master,
                                                                    "config": r.drafter.config.to_json(),
                                                                    "evals": r.evals, "sessions": r.sessions,
                                                                    "curve": r.curve[::5]} for r in runs}}
        if a.light_state:
            final = out / "state"
            shutil.copytree(exports[best.name], out / "ckpt", dirs_exist_ok=True)
            names = save_state(final, *run_state(best, loop, args, light=True))
            written += sorted((out / "ckpt").iterdir()) + [final / n for n in names]
            index = json.loads((final / "state.json").read_text())
            index["session"] = session
            (final / "state.json").write_text(json.dumps(index, indent=1))
            _log(f"best run {best.name}: checkpoint in {out / 'ckpt'}, light state in {final}")
        else:
            tensors, meta = run_state(best, loop, args)
            final = work / "state-final"  # the whole state stays here; $OUT gets what the link returns
            names = save_state(final, tensors, meta)
            index = json.loads((final / "state.json").read_text())
            index["session"] = session
            (final / "state.json").write_text(json.dumps(index, indent=1))
            room = a.return_mib * 2 ** 20 - 2 ** 20 - sum(p.stat().st_size for p in written)  # 1 MiB: state.json grows
            left = []
            for n in names:
                size = (final / n).stat().st_size
                if len(written) < a.return_files and size <= room:
                    shutil.copy(final / n, out / n)
                    written.append(out / n)
                    room -= size
                else:
                    left.append(n)
            if left:
                _log(f"{len(left)} state parts exceed what one call returns; fetch them with a follow-up call: "
                     f"cp {' '.join(str(final / n) for n in left)} $OUT/")
        if a.accept_n:
            from bench.acceptance import compare
            from modeling.defaults import DEFAULT_DRAFTER_DIR

            modes = [("chain", 0) if m == "chain" else ("tree", int(m.split("@")[1])) for m in a.accept_modes.split(",")]
            torch.cuda.empty_cache() if cuda else None
            fast = "graphs" if cuda else "off"  # the serving path: same kernels, ~10x less time per round
            try:  # a failure here must not cost the training state
                session["acceptance"] = {
                    "where": f"{session['device']}, {dt}, in-process engines (fast={fast}), T=0",
                    "n": a.accept_n, "max_new": a.accept_max_new,
                    "results": compare({"shipped": str(DEFAULT_DRAFTER_DIR),
                                        **({r: str(d) for r, d in exports.items()} if a.light_state
                                           else {"new": str(exports[best.name])})}, target,
                                       gguf, a.accept_n, a.accept_max_new, modes, dev, dt, fast, _log)}
            except Exception as e:  # noqa: BLE001 — reported in the session record and the log
                session["acceptance"] = {"error": repr(e)}
                _log(f"acceptance failed: {e!r}")
        if "acceptance" in session:  # after the state is safe in --out: its state.json gains the table
            index["session"] = session
            for d in (final,) if a.light_state else (final, out):
                (d / "state.json").write_text(json.dumps(index, indent=1))
    else:
        (out / "session.json").write_text(json.dumps(session, indent=1))
        written.append(out / "session.json")
    if len(written) > a.return_files:
        _log(f"WARNING: {len(written)} files in --out; the device link returns 8")
    _log(f"done: {[p.name for p in written]}")


if __name__ == "__main__":
    main()
