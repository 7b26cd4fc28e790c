"""Training loop (plans/0002, 0008): one or more drafters trained in lock-step on the same
batches (one frozen target forward feeds all of them), resumable across sessions.

The loop state (global step, schedule plan, the epoch's remaining data order, RNG states,
held-out job ids) and each run's weights, bf16 AdamW moments and curves are saved with
``run_state`` and restored with ``restore_run``; a restored run continues exactly where the
saved one stopped, and its held-out τ̂ curve is appended to, not restarted. Held-out τ̂ is
measured with a copy of the drafter in the target's dtype (bf16 on the GPU = serving dtype).
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from modeling.dflash import DFlashConfig, DFlashDrafter
from training.batched import target_features
from training.optim import AdamW16
from training.recipe import (IGNORE, accept_lengths, blocks_forward, chunked_loss_backward, loss_weights,
                             make_blocks, sample_anchors, select_rows, teacher_rows)


@dataclass
class TrainArgs:
    budget_s: float = 300.0  # this session's training seconds (evaluations included); 0 = max_steps only
    batch_seqs: int = 16
    max_anchors: int = 64
    lr: float = 8e-4
    min_lr_frac: float = 0.1  # cosine floor; after plan_steps the lr stays there
    warmup_steps: int = 100
    plan_s: float = 0.0  # planned training seconds over all sessions → plan_steps after timing (0: budget_s)
    plan_steps: int = 0  # fixed schedule length (overrides plan_s); kept across sessions once set
    weight_decay: float = 0.01
    clip: float = 1.0
    timing_steps: int = 30  # steps whose mean time sets plan_steps (evaluation seconds inside excluded)
    timing_warmup: int = 10  # steps before the timing window (CUDA warm-up, allocator, a neighbour starting)
    replan: bool = False  # re-time the schedule from this session's timing window (a resumed run: decay now)
    replan_lr: float = 0.0  # lr during a re-plan's timing window (0: the previous schedule's at this peak)
    max_steps: int = 0  # steps this session (0: until the budget)
    eval_every: int = 500
    eval_seqs: int = 128
    seed: int = 0
    trim_loops: int = 0  # n-gram size: training sequences cut where a response loops (training.data.trim_loops); 0 = off
    cycle: bool = False  # a new schedule cycle from this session's first step: warm-up, then a cosine timed to the budget
    heldout_prompts: tuple = ()  # training.heldout keys held out by an earlier lineage: chosen first, never trained on


@dataclass
class Loop:
    """State shared by lock-step runs: the next global step, the schedule length, the epoch's
    remaining job ids, the epoch count, the held-out job ids and two RNGs (data order; anchors).
    ``plan_start``: the global step where the current schedule cycle began (0 for the first;
    ``TrainArgs.cycle`` starts a new one, warm-up included, e.g. after the moments were dropped)."""

    step: int = 0
    plan_steps: int = 0
    order: list = field(default_factory=list)
    epoch: int = 0
    eval_ids: list = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    gen: torch.Generator = field(default_factory=torch.Generator)
    plan_start: int = 0

    @classmethod
    def fresh(cls, seed: int) -> "Loop":
        return cls(rng=random.Random(seed), gen=torch.Generator().manual_seed(seed))


@dataclass
class Run:
    name: str
    drafter: DFlashDrafter
    opt: AdamW16
    weights: torch.Tensor
    kl: float = 0.0  # 0: hard labels; 1: KL to the target only; between: mixture
    master: str = "fp32"  # "fp32" master weights, or "bf16" (serving dtype, stochastic rounding)
    curve: list = field(default_factory=list)  # (global step, loss, running τ~, grad norm, lr); older states: no lr
    evals: list = field(default_factory=list)  # {"step", "loss", "tau_hat", "p_accept_ge", "session"}
    sessions: list = field(default_factory=list)
    lr_scale: dict = field(default_factory=dict)  # parameter-name prefix → lr multiplier (e.g. grown layers)
    early: tuple | None = None  # anchors weighted toward the response's start: (W, share), recipe.sample_anchors


def new_run(name: str, config: DFlashConfig, device, kl: float = 0.0, master: str = "fp32",
            init_state: dict | None = None, args: TrainArgs | None = None, lr_scale: dict | None = None,
            early: tuple[int, float] | None = None) -> Run:
    """A run from scratch (seeded init) or from ``init_state`` (a drafter state dict).
    ``lr_scale``: {parameter-name prefix: lr multiplier}, e.g. {"layers.4.": 10.0}; ``early``:
    this run's anchor weighting (W, share) (``recipe.sample_anchors``; None: uniform)."""
    args = args or TrainArgs()
    lr_scale = dict(lr_scale or {})
    if early is not None and not (early[0] >= 0 and 0 <= early[1] <= 1):
        raise ValueError(f"run {name}: early anchors {tuple(early)} need W >= 0 and 0 <= share <= 1")
    if early is not None and not (early[0] > 0 and early[1] > 0):
        early = None  # W 0 or share 0 is the uniform draw: the uniform runs' anchors (loop.gen), not a stream of its own
    d = DFlashDrafter.random(config, seed=args.seed)
    if init_state is not None:
        d.load_state_dict({k: v.float() for k, v in init_state.items()})
    d.to(device, torch.bfloat16 if master == "bf16" else torch.float32).train()
    scales = [next((f for pre, f in lr_scale.items() if n.startswith(pre)), 1.0) for n, _ in d.named_parameters()]
    opt = AdamW16(d.parameters(), weight_decay=args.weight_decay, seed=args.seed, lr_scales=scales)
    return Run(name, d, opt, loss_weights(config.block_size), kl, master, lr_scale=lr_scale,
               early=tuple(early) if early else None)


def lr_at(step: int, total: int, warmup: int, peak: float, min_frac: float = 0.0) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine to ``min_frac``·peak at
    ``total`` (and flat there after it)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    x = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * x)))


def make_batch(data: dict, ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Right-padded tokens [b, L] int64 on ``device``, lengths [b] (CPU), prompt lengths, for
    data indices ``ids``."""
    seqs = [data["tokens"][i].long() for i in ids]
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = s
    return tokens.to(device), lengths, [data["prompt_lens"][i] for i in ids]


def run_step(drafter, weights, target, features, tokens_cpu, lengths, anchors, train: bool, amp,
             final=None, kl: float = 0.0):
    """One forward (+ backward) of one drafter on a batch. Returns (loss, accept lengths [n])."""
    c = drafter.config
    blocks = make_blocks(tokens_cpu, lengths, anchors, c.block_size, c.mask_token_id).to(features.device)
    embed = target.model.embed_tokens.weight
    with amp():
        with torch.set_grad_enabled(train):
            hidden = blocks_forward(drafter, embed, features, blocks)
            h, labels, w, _ = select_rows(hidden, blocks, weights)
        teacher = teacher_rows(final, blocks) if kl > 0 else None
        loss, preds = chunked_loss_backward(h, labels, w, target.lm_head.weight, backward=train, teacher=teacher,
                                            kl=kl)
    full = torch.full_like(blocks.labels, -1)
    full[blocks.labels != IGNORE] = preds
    return loss, accept_lengths(full, blocks)


@torch.no_grad()
def evaluate(run: Run, target, data, eval_idx: list[int], args: TrainArgs, first: int = 0) -> dict:
    """Held-out CE loss and τ̂ = 1 + mean chain acceptance over all anchors (T=0, greedy data),
    plus P(accepted ≥ k) for k = 1…B−1, with a copy of the drafter in the target's dtype (the
    serving dtype on the GPU) and fixed anchors (seed 1234). ``first`` > 0: only the first
    ``first`` response tokens count (anchors and labels), the regime of the acceptance bench;
    long greedy responses are mostly repetition loops, which inflate τ̂ over all anchors."""
    dtype = target.lm_head.weight.dtype
    device = target.lm_head.weight.device
    d = DFlashDrafter(run.drafter.config)
    d.load_state_dict({k: v.float() for k, v in run.drafter.state_dict().items()})
    d.to(device, dtype).eval()
    gen = torch.Generator().manual_seed(1234)
    losses, acc = [], []
    for s in range(0, len(eval_idx), args.batch_seqs):
        ids = eval_idx[s:s + args.batch_seqs]
        tokens, lengths, plens = make_batch(data, ids, device)
        if first:  # causal features: positions before the cut do not see what follows it
            lengths = torch.minimum(lengths, torch.tensor(plens) + first + 1)
        feats = target_features(target, tokens, d.config.target_layer_ids)
        anchors = [sample_anchors(p, int(n), args.max_anchors, gen) for p, n in zip(plens, lengths)]
        loss, a = run_step(d, run.weights, target, feats, tokens.cpu(), lengths, anchors, False,
                           contextlib.nullcontext)
        losses.append(loss)
        acc.append(a.cpu())
    a = torch.cat(acc).float()
    B = d.config.block_size
    return {"loss": round(sum(losses) / max(1, len(losses)), 4), "tau_hat": round(1 + float(a.mean()), 4),
            "p_accept_ge": [round(float((a >= k).float().mean()), 4) for k in range(1, B)],
            "dtype": str(dtype).replace("torch.", "")}


def _job_ids(data: dict) -> list[int]:
    return list(data.get("job_ids") or range(len(data["tokens"])))


def choose_eval_ids(data: dict, eval_seqs: int, seed: int, prompts: set[str] = frozenset()) -> list[int]:
    """Held-out job ids: ``eval_seqs`` greedy sequences (at most a tenth of them, at least one) —
    first those whose prompt is in ``prompts`` (``training.heldout`` keys: an earlier lineage's
    held-out prompts), the rest by ``seed``. Raises ValueError when the data holds no greedy
    sequence (nothing to hold out)."""
    from training.heldout import prompt_keys

    ids = _job_ids(data)
    greedy = [j for j, t in zip(ids, data["temps"]) if t == 0.0]
    if not greedy:
        raise ValueError(f"no greedy sequence among {len(ids)} to hold out (all sampled): generate more data")
    n = min(eval_seqs, len(greedy) // 10 or 1)
    keys = dict(zip(ids, prompt_keys(data))) if prompts else {}
    known = [j for j in greedy if keys.get(j) in prompts][:n]
    taken = set(known)
    rest = [j for j in greedy if j not in taken]
    return sorted(known + random.Random(seed).sample(rest, n - len(known)))


def training_ids(data: dict, eval_ids: list[int], heldout: set[str] = frozenset()) -> list[int]:
    """Job ids to train on: every sequence except the held-out ones and every other answer (sampled
    or resampled) to a held-out prompt — theirs and the ``heldout`` keys of an earlier lineage."""
    from training.heldout import prompt_keys

    out = heldout_prompts(data, eval_ids) | heldout
    return [j for j, k in zip(_job_ids(data), prompt_keys(data)) if k not in out]


def heldout_prompts(data: dict, eval_ids: list[int]) -> set[str]:
    """The prompt keys (``training.heldout``) of the held-out sequences found in ``data``."""
    from training.heldout import prompt_keys

    held = set(eval_ids)
    return {k for j, k in zip(_job_ids(data), prompt_keys(data)) if j in held}


def train_session(target, data: dict, runs: list[Run], loop: Loop, args: TrainArgs, log=print,
                  tag: str = "") -> None:
    """Continue ``runs`` (lock-step, same tapped layers) on ``data`` from ``loop`` for
    ``args.budget_s`` seconds or ``args.max_steps`` steps; evaluates at the start, every
    ``eval_every`` global steps and at the end. Mutates runs and loop.

    Without a plan (a fresh run), or with ``args.replan``, the schedule length is set from the
    mean step time over ``timing_steps`` steps after ``timing_warmup`` steps (evaluation seconds
    inside the window excluded): the cosine ends when the budget (or ``plan_s``) does, less the
    evaluations still to come. A re-plan keeps the previous schedule's lr (``replan_lr`` if
    set) until the new plan exists, so the timing steps do not jump to the peak."""
    t_begin = time.time()
    device = target.lm_head.weight.device
    cuda = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    taps = {r.drafter.config.target_layer_ids for r in runs}
    assert len(taps) == 1, "lock-step runs share the target forward, so the taps must agree"
    taps = next(iter(taps))
    final = any(r.kl > 0 for r in runs)
    job_ids = _job_ids(data)
    index = {j: i for i, j in enumerate(job_ids)}
    if not loop.eval_ids:
        loop.eval_ids = choose_eval_ids(data, args.eval_seqs, args.seed, set(args.heldout_prompts))
    held = set(loop.eval_ids)
    eval_idx = [index[j] for j in loop.eval_ids if j in index]
    if len(eval_idx) < len(loop.eval_ids):
        log(f"{len(loop.eval_ids) - len(eval_idx)} held-out sequences are not in this session's data")
    train_ids = training_ids(data, loop.eval_ids, set(args.heldout_prompts))
    if len(train_ids) + len(eval_idx) < len(job_ids):
        log(f"{len(job_ids) - len(train_ids) - len(eval_idx)} more sequences left out: answers to held-out prompts")
    if args.trim_loops:  # training sequences only: the held-out set (and its τ̂ curve) stays as it was
        from training.data import trim_loops

        before = sum(len(t) for t in data["tokens"])
        data = {**data, "tokens": [t if j in held else trim_loops(t, p, args.trim_loops)
                                   for j, t, p in zip(job_ids, data["tokens"], data["prompt_lens"])]}
        log(f"trim_loops({args.trim_loops}): {before} → {sum(len(t) for t in data['tokens'])} tokens "
            f"({time.time() - t_begin:.0f} s, counted in the budget)")
    if args.budget_s:  # the preparation above is part of this session's seconds
        args.budget_s = max(1.0, args.budget_s - (time.time() - t_begin))
    if args.plan_steps and not loop.plan_steps:
        loop.plan_steps = args.plan_steps
    if args.cycle:  # a new cycle: warm-up from this step, the cosine timed like a re-plan
        loop.plan_start, loop.plan_steps = loop.step, 0
    log(f"train seqs {len(train_ids)} eval seqs {len(eval_idx)} runs {[r.name for r in runs]} "
        f"from step {loop.step} (plan {loop.plan_steps or 'after timing'}) epoch {loop.epoch}")
    t0, first, t_eval, eval_s = time.time(), loop.step, 0.0, 0.0
    replanning = args.replan or not loop.plan_steps
    window = None  # (time, evaluation seconds) when the timing window opened
    # GPU seconds this session: the shared target forward, and each run's own step (synchronised
    # around each part, so lock-step runs of different sizes can be compared at equal time)
    t_target, t_run = 0.0, {r.name: 0.0 for r in runs}

    def do_eval():
        nonlocal t_eval, eval_s
        te = time.time()
        for r in runs:
            if r.evals and r.evals[-1]["step"] == loop.step and not r.evals[-1].get("inherited"):
                continue  # (evaluations inherited from a lineage: this run is evaluated again, its "before")
            ev = evaluate(r, target, data, eval_idx, args)
            ev["tau_hat_first64"] = evaluate(r, target, data, eval_idx, args, first=64)["tau_hat"]
            r.evals.append({"step": loop.step, **ev, "session": tag,
                            "train_s": round(t_target + t_run[r.name], 1)})  # this session's: target + own steps
            log(f"eval {r.name} step {loop.step}: loss {ev['loss']:.3f} tau_hat {ev['tau_hat']:.3f} "
                f"(first 64 response tokens: {ev['tau_hat_first64']:.3f})")
        t_eval = max(t_eval, time.time() - te)
        eval_s += time.time() - te

    do_eval()
    while True:
        done_steps = loop.step - first
        if args.max_steps and done_steps >= args.max_steps:
            break
        if args.budget_s and time.time() - t0 + 1.2 * t_eval > args.budget_s:
            break
        if replanning and done_steps == args.timing_warmup:
            window = (time.time(), eval_s)
        if replanning and done_steps == args.timing_warmup + args.timing_steps:
            now = time.time()
            per_step = max(1e-6, (now - window[0] - (eval_s - window[1])) / args.timing_steps)
            left = (args.plan_s or args.budget_s) - (now - t0) - 1.2 * t_eval  # the final evaluation's reserve
            steps = int(left / (per_step + t_eval / args.eval_every))  # evaluations every eval_every steps
            old, loop.plan_steps, replanning = loop.plan_steps, max(loop.step + 1, loop.step + steps), False
            log(f"{per_step * 1000:.0f} ms/step (steps {first + args.timing_warmup}-{loop.step}, evaluations "
                f"excluded) → plan {loop.plan_steps} steps (was {old or 'none'}), warmup {args.warmup_steps}")
        ids = []
        while len(ids) < args.batch_seqs:
            if not loop.order:
                loop.order = train_ids[:]
                loop.rng.shuffle(loop.order)
                loop.epoch += 1
            j = loop.order.pop()
            if j in index:
                ids.append(index[j])
        tt = time.time()
        tokens, lengths, plens = make_batch(data, ids, device)
        if final:
            feats, fin = target_features(target, tokens, taps, final=True)
        else:
            feats, fin = target_features(target, tokens, taps), None
        if cuda:
            torch.cuda.synchronize()
        t_target += time.time() - tt
        # per anchor weighting of the runs: uniform runs draw from the loop's generator, as they always did;
        # weighted ones from a generator of their own seeded by the step (resumable; the uniform draws unchanged)
        anchors = {None: [sample_anchors(p, int(n), args.max_anchors, loop.gen) for p, n in zip(plens, lengths)]}
        for e in {r.early for r in runs} - {None}:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + loop.step)
            anchors[e] = [sample_anchors(p, int(n), args.max_anchors, g, e) for p, n in zip(plens, lengths)]
        tok_cpu = tokens.cpu()
        if replanning and args.replan and args.replan_lr:
            lr = args.replan_lr
        else:  # while a re-plan times its steps, loop.plan_steps is still the previous schedule
            total = loop.plan_steps - loop.plan_start if loop.plan_steps else 10 ** 9
            lr = lr_at(loop.step - loop.plan_start, total, args.warmup_steps, args.lr, args.min_lr_frac)
        for r in runs:
            tr = time.time()
            r.opt.zero_grad()
            loss, acc = run_step(r.drafter, r.weights, target, feats, tok_cpu, lengths, anchors[r.early], True, amp, fin,
                                 r.kl)
            gnorm = float(torch.nn.utils.clip_grad_norm_(r.drafter.parameters(), args.clip))
            r.opt.step(lr)
            if cuda:
                torch.cuda.synchronize()
            t_run[r.name] += time.time() - tr
            r.curve.append((loop.step, round(loss, 4), round(1 + float(acc.float().mean()), 3), round(gnorm, 3),
                            float(f"{lr:.6g}")))
        loop.step += 1
        if loop.step % 50 == 0:
            log(f"step {loop.step} t={time.time() - t0:.0f}s lr={lr:.2e} "
                + " ".join(f"{r.name}: loss {r.curve[-1][1]:.3f} tau~{r.curve[-1][2]:.2f}" for r in runs))
        if loop.step % args.eval_every == 0:
            do_eval()
    do_eval()
    secs = time.time() - t0
    for r in runs:
        r.sessions.append({"tag": tag, "start_step": first, "end_step": loop.step, "seconds": round(secs, 1),
                           "ms_per_step": round(1000 * (secs - eval_s) / max(1, loop.step - first), 1),
                           "target_s": round(t_target, 1), "run_s": round(t_run[r.name], 1),
                           "sequences": len(job_ids), "device": torch.cuda.get_device_name() if cuda else "cpu"})


def run_state(run: Run, loop: Loop, args: TrainArgs, light: bool = False) -> tuple[dict, dict]:
    """(tensors, meta) that ``restore_run`` turns back into this run and loop, bit for bit.
    ``light``: without weights and moments (~5 KB instead of ~87 MiB for 4 layers): the weights
    travel as the exported checkpoint (bf16 master: the same values) and the moments are
    dropped — with β2 = 0.95 they remember ~20 steps, so a resumed run re-estimates them within
    its warm-up (``TrainArgs.cycle``); the rest (step, data order, RNGs, curves) is kept.
    ValueError for ``light`` on an fp32-master run (its bf16 checkpoint would round the weights)."""
    if light and run.master != "bf16":
        raise ValueError(f"a light state needs a bf16 master (run {run.name!r} keeps {run.master} weights, "
                         "which its bf16 checkpoint would round): save the full state")
    tensors = {} if light else {f"w.{k}": v for k, v in run.drafter.state_dict().items()}
    if not light:
        tensors.update({f"opt.{k}": v for k, v in run.opt.state_tensors().items()})
    tensors["loop.gen"] = loop.gen.get_state()
    v, st, gauss = loop.rng.getstate()
    meta = {"name": run.name, "config": run.drafter.config.to_json(), "kl": run.kl, "master": run.master,
            "curve": run.curve, "evals": run.evals, "sessions": run.sessions, "args": asdict(args), "lr_scale": run.lr_scale,
            "early": list(run.early) if run.early else None,
            "loop": {"step": loop.step, "plan_steps": loop.plan_steps, "plan_start": loop.plan_start,
                     "order": loop.order, "epoch": loop.epoch, "eval_ids": loop.eval_ids, "rng": [v, list(st), gauss]}}
    if light:
        meta["weights"] = "the exported checkpoint (restore_run(weights_dir=...)); optimizer moments dropped"
    return tensors, meta


def restore_run(tensors: dict, meta: dict, device, weights_dir=None) -> tuple[Run, Loop]:
    """Inverse of ``run_state``: the run on ``device`` and its loop state. A light state
    (no ``w.*``) takes its weights from the checkpoint at ``weights_dir`` (ValueError if not
    given or of another shape); without ``opt.*`` the moments start at zero."""
    c = DFlashConfig.from_json(meta["config"])
    a = TrainArgs(**meta["args"])
    run = new_run(meta["name"], c, device, meta["kl"], meta["master"], args=a, lr_scale=meta.get("lr_scale"),
                  early=meta.get("early"))
    w = {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
    if not w:
        if weights_dir is None:
            raise ValueError("a light training state holds no weights: give the checkpoint directory (weights_dir)")
        d = DFlashDrafter.load(weights_dir)
        if d.config.to_json() != c.to_json():
            raise ValueError(f"checkpoint {weights_dir} does not match the state's config")
        w = d.state_dict()
    run.drafter.load_state_dict({k: v.to(run.drafter.fc.weight.dtype) for k, v in w.items()})
    if any(k.startswith("opt.") for k in tensors):
        run.opt.load_state_tensors({k[4:]: v.to(device) if k[4:].startswith(("m.", "v.")) else v
                                    for k, v in tensors.items() if k.startswith("opt.")})
    run.curve = [tuple(x) for x in meta["curve"]]
    run.evals, run.sessions = meta["evals"], meta["sessions"]
    lp = meta["loop"]
    rng = random.Random()
    rng.setstate((lp["rng"][0], tuple(lp["rng"][1]), lp["rng"][2]))
    gen = torch.Generator()
    gen.set_state(tensors["loop.gen"])
    loop = Loop(lp["step"], lp["plan_steps"], list(lp["order"]), lp["epoch"], list(lp["eval_ids"]), rng, gen,
                lp.get("plan_start", 0))
    return run, loop


def grow(state: dict, config: DFlashConfig, seed: int = 0) -> dict:
    """A drafter state dict for ``config`` (more layers) from a trained shallower one: its
    weights kept, the new layers appended after them with fresh weights except zero output
    projections (``self_attn.o_proj``, ``mlp.down_proj``), so each new layer adds nothing to the
    residual stream and the grown drafter computes exactly what ``state`` did (plans/0008)."""
    new = DFlashDrafter.random(config, seed=seed).state_dict()
    missing = [k for k in state if k not in new]
    if missing:
        raise ValueError(f"cannot grow: {missing[:3]} not in the new config")
    old_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    out = {}
    for k, v in new.items():
        if k in state:
            out[k] = state[k].float()
        elif k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            assert int(k.split(".")[1]) >= old_layers
            out[k] = torch.zeros_like(v)
        else:
            out[k] = v
    return out


def train(target, data: dict, configs: dict[str, DFlashConfig], args: TrainArgs,
          init_states: dict[str, dict] | None = None, log=print, kl: float = 0.0, master: str = "fp32") -> list[Run]:
    """Fresh runs (one per config, optionally initialised from ``init_states``) trained in
    lock-step for one session (with ``max_steps`` and no plan: the schedule spans max_steps,
    warm-up 4 % of it, as in plans/0002)."""
    if args.max_steps and not args.plan_steps:
        args = TrainArgs(**{**asdict(args), "plan_steps": args.max_steps,
                            "warmup_steps": max(1, round(0.04 * args.max_steps))})
    device = target.lm_head.weight.device
    torch.manual_seed(args.seed)
    runs = [new_run(n, c, device, kl, master, (init_states or {}).get(n), args) for n, c in configs.items()]
    train_session(target, data, runs, Loop.fresh(args.seed), args, log)
    return runs


def drafter_from_state(tensors: dict, meta: dict) -> DFlashDrafter:
    """The drafter's weights alone from a saved training state (any device: a state saved on
    the GPU carries a CUDA generator state that a CPU optimizer cannot take, so no optimizer
    is built). Weights keep their master dtype (bf16 or fp32)."""
    d = DFlashDrafter(DFlashConfig.from_json(meta["config"]))
    w = {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
    d.to(next(iter(w.values())).dtype).load_state_dict(w)
    return d


def export_bf16(drafter: DFlashDrafter, directory, heldout: set[str] | None = None) -> None:
    """Write the drafter in the published layout with bf16 weights (shards ≤ 16 MiB), and its
    lineage's held-out prompt keys (``training.heldout``) when given."""
    copy = DFlashDrafter(drafter.config)
    copy.load_state_dict({k: v.detach().float().cpu() for k, v in drafter.state_dict().items()})
    copy.to(torch.bfloat16).save(directory, shard_bytes=15 * 2 ** 20)
    if heldout:
        from training.heldout import save

        save(directory, heldout)


def summary(runs: list[Run], extra: dict) -> dict:
    return {**extra, "runs": {r.name: {"config": r.drafter.config.to_json(), "kl": r.kl, "master": r.master,
                                       "steps": len(r.curve), "final_train_loss": r.curve[-1][1] if r.curve else None,
                                       "evals": r.evals, "sessions": r.sessions, "curve": r.curve[::10]} for r in runs}}


def save_json(obj, path) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
