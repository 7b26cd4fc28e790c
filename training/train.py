"""Training loop: one or more drafters trained in lock-step on the same batches (one frozen
target forward feeds all of them), with a time-budgeted cosine schedule, offline τ̂ on held-out
greedy sequences, and bf16 export in the published layout (plans/0002)."""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field

import torch

from modeling.dflash import DFlashConfig, DFlashDrafter
from training.batched import target_features
from training.recipe import (accept_lengths, blocks_forward, chunked_loss_backward, loss_weights, make_blocks,
                             sample_anchors, select_rows)


@dataclass
class TrainArgs:
    budget_s: float = 300.0
    batch_seqs: int = 8
    max_anchors: int = 512
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    clip: float = 1.0
    timing_steps: int = 30  # steps timed before the step count (and schedule) is fixed
    max_steps: int = 0  # 0: from the time budget
    eval_every: int = 400
    eval_seqs: int = 128
    seed: int = 0


@dataclass
class Run:
    name: str
    drafter: DFlashDrafter
    opt: torch.optim.Optimizer
    weights: torch.Tensor
    curve: list = field(default_factory=list)
    evals: list = field(default_factory=list)


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine to 0 at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def split_data(data: dict, eval_seqs: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices; eval = ``eval_seqs`` greedy sequences drawn with ``seed``, never
    trained on."""
    idx = list(range(len(data["tokens"])))
    greedy = [i for i in idx if data["temps"][i] == 0.0]
    ev = set(random.Random(seed).sample(greedy, min(eval_seqs, len(greedy) // 10 or 1)))
    return [i for i in idx if i not in ev], sorted(ev)


def make_batch(data: dict, ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Right-padded tokens [b, L] int64 on ``device``, lengths [b] (CPU), prompt lengths."""
    seqs = [data["tokens"][i].long() for i in ids]
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = s
    return tokens.to(device), lengths, [data["prompt_lens"][i] for i in ids]


def run_step(run: Run, target, features, tokens_cpu, lengths, anchors, train: bool, amp):
    """One forward (+ backward) of one drafter on a batch. Returns (loss, accept lengths [n])."""
    c = run.drafter.config
    blocks = make_blocks(tokens_cpu, lengths, anchors, c.block_size, c.mask_token_id).to(features.device)
    embed = target.model.embed_tokens.weight
    with amp():
        with torch.set_grad_enabled(train):
            hidden = blocks_forward(run.drafter, embed, features, blocks)
            h, labels, w, _ = select_rows(hidden, blocks, run.weights)
        loss, preds = chunked_loss_backward(h, labels, w, target.lm_head.weight, backward=train)
    full = torch.full_like(blocks.labels, -1)
    full[blocks.labels != -100] = preds
    return loss, accept_lengths(full, blocks)


@torch.no_grad()
def evaluate(run: Run, target, data, eval_ids, args: TrainArgs, amp) -> dict:
    """Held-out loss and τ̂ = 1 + mean chain acceptance over all anchors (T=0, greedy data),
    plus P(accepted ≥ k) for k = 1…B−1."""
    run.drafter.eval()
    gen = torch.Generator().manual_seed(1234)
    losses, acc = [], []
    for s in range(0, len(eval_ids), args.batch_seqs):
        ids = eval_ids[s:s + args.batch_seqs]
        tokens, lengths, plens = make_batch(data, ids, target.lm_head.weight.device)
        feats = target_features(target, tokens, run.drafter.config.target_layer_ids)
        anchors = [sample_anchors(p, int(n), args.max_anchors, gen) for p, n in zip(plens, lengths)]
        loss, a = run_step(run, target, feats, tokens.cpu(), lengths, anchors, False, amp)
        losses.append(loss)
        acc.append(a.cpu())
    run.drafter.train()
    a = torch.cat(acc).float()
    B = run.drafter.config.block_size
    return {"loss": sum(losses) / max(1, len(losses)), "tau_hat": 1 + float(a.mean()),
            "p_accept_ge": [round(float((a >= k).float().mean()), 4) for k in range(1, B)]}


def train(target, data: dict, configs: dict[str, DFlashConfig], args: TrainArgs,
          init_states: dict[str, dict] | None = None, log=print) -> list[Run]:
    """Train drafters ``configs`` (name → config, all with the same tapped layers) in lock-step
    for ``args.budget_s`` seconds (or ``max_steps``). The target is frozen; bf16 autocast on GPU."""
    device = target.lm_head.weight.device
    cuda = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    taps = {c.target_layer_ids for c in configs.values()}
    assert len(taps) == 1, "lock-step runs share the target forward, so the taps must agree"
    taps = next(iter(taps))
    torch.manual_seed(args.seed)
    runs = []
    for name, c in configs.items():
        d = DFlashDrafter(c)
        if init_states and name in init_states:
            d.load_state_dict(init_states[name])
        d.to(device).train()
        opt = torch.optim.AdamW(d.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                                fused=cuda)
        runs.append(Run(name, d, opt, loss_weights(c.block_size)))
    train_ids, eval_ids = split_data(data, args.eval_seqs, args.seed)
    log(f"train seqs {len(train_ids)} eval seqs {len(eval_ids)} configs {list(configs)}")
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    order: list[int] = []
    total, warmup = args.max_steps or 10 ** 9, max(1, round(args.warmup_frac * (args.max_steps or 10_000)))
    t0, step = time.time(), 0
    while step < total:
        if step == args.timing_steps and not args.max_steps:
            per_step = (time.time() - t0) / step
            total = max(step + 1, int(args.budget_s / per_step))
            warmup = max(step, round(args.warmup_frac * total))
            log(f"{per_step * 1000:.0f} ms/step → {total} steps, warmup {warmup}")
        if len(order) < args.batch_seqs:
            order = train_ids[:]
            rng.shuffle(order)
        ids, order = order[:args.batch_seqs], order[args.batch_seqs:]
        tokens, lengths, plens = make_batch(data, ids, device)
        feats = target_features(target, tokens, taps)
        anchors = [sample_anchors(p, int(n), args.max_anchors, gen) for p, n in zip(plens, lengths)]
        tok_cpu = tokens.cpu()
        for run in runs:
            for g in run.opt.param_groups:
                g["lr"] = lr_at(step, total, warmup, args.lr)
            run.opt.zero_grad(set_to_none=True)
            loss, acc = run_step(run, target, feats, tok_cpu, lengths, anchors, True, amp)
            gnorm = float(torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), args.clip))
            run.opt.step()
            run.curve.append((step, round(loss, 4), round(1 + float(acc.float().mean()), 3), round(gnorm, 3)))
        step += 1
        if step % 50 == 0 or step == total:
            log(f"step {step}/{total} t={time.time() - t0:.0f}s lr={lr_at(step - 1, total, warmup, args.lr):.2e} "
                + " ".join(f"{r.name}: loss {r.curve[-1][1]:.3f} tau~{r.curve[-1][2]:.2f}" for r in runs))
        if step % args.eval_every == 0 or step == total:
            for r in runs:
                ev = evaluate(r, target, data, eval_ids, args, amp)
                r.evals.append({"step": step, **ev})
                log(f"eval {r.name} step {step}: loss {ev['loss']:.3f} tau_hat {ev['tau_hat']:.3f}")
    return runs


def export_bf16(drafter: DFlashDrafter, directory) -> None:
    """Write the drafter in the published layout with bf16 weights (shards ≤ 16 MiB)."""
    copy = DFlashDrafter(drafter.config)
    copy.load_state_dict({k: v.detach().cpu() for k, v in drafter.state_dict().items()})
    copy.to(torch.bfloat16).save(directory, shard_bytes=15 * 2 ** 20)


def summary(runs: list[Run], extra: dict) -> dict:
    return {**extra, "runs": {r.name: {"config": r.drafter.config.to_json(), "steps": len(r.curve),
                                       "final_train_loss": r.curve[-1][1] if r.curve else None,
                                       "evals": r.evals, "curve": r.curve[::10]} for r in runs}}


def save_json(obj, path) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)

