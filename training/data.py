"""Self-distillation data: the target regenerates responses to the training prompts
(plans/0002, 0008): every prompt once greedy, plus sampled responses (T ∈ U[t_lo, t_hi]) making
up a share of the jobs, chat template (if any) already in the prompt ids. ``generate_shards``
is the resumable, sharded form: job ids index the deterministic job list, shards record the
ids they hold, and a later session generates only the jobs no shard holds yet."""
from __future__ import annotations

import random
import time

import torch

from training.batched import generate


def generation_jobs(n_prompts: int, sampled_share: float, t_lo: float, t_hi: float, seed: int
                    ) -> list[tuple[int, float]]:
    """(prompt index, temperature) jobs: all prompts greedy (0.0) plus enough sampled jobs that
    they make ``sampled_share`` of the total."""
    rng = random.Random(seed)
    jobs = [(i, 0.0) for i in range(n_prompts)]
    n_sampled = round(n_prompts * sampled_share / (1 - sampled_share))
    jobs += [(rng.randrange(n_prompts), rng.uniform(t_lo, t_hi)) for _ in range(n_sampled)]
    return jobs


def resample_jobs(n_prompts: int, t_lo: float, t_hi: float, round_: int) -> list[tuple[int, float]]:
    """Resampling round ``round_`` (≥ 1): every prompt once, in a seeded order, sampled at
    T ~ U[t_lo, t_hi] — fresh responses to the same prompts once every greedy job is done.
    Rounds are appended after the base ``generation_jobs`` list, so job ids stay unique."""
    rng = random.Random(1_000_003 * round_)
    order = list(range(n_prompts))
    rng.shuffle(order)
    return [(i, rng.uniform(t_lo, t_hi)) for i in order]


def generate_dataset(model, prompts: list[list[int]], eos_ids: tuple[int, ...], batch: int = 1024,
                     max_new_tokens: int = 384, sampled_share: float = 0.25, t_range=(0.7, 1.0),
                     budget_s: float = 1e9, seed: int = 0, log=print) -> dict:
    """Run the jobs in batches of similar prompt length (batch order shuffled, so a time budget
    cuts evenly) until done or ``budget_s`` seconds. Returns {"tokens": [int32 [n]],
    "prompt_lens": [int], "temps": [float]} (prompt + response, response ends at EOS if hit)."""
    jobs = generation_jobs(len(prompts), sampled_share, *t_range, seed)
    jobs.sort(key=lambda j: len(prompts[j[0]]))
    batches = [jobs[i:i + batch] for i in range(0, len(jobs), batch)]
    random.Random(seed).shuffle(batches)
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    out = {"tokens": [], "prompt_lens": [], "temps": []}
    t0, new = time.time(), 0
    for k, bj in enumerate(batches):
        if time.time() - t0 > budget_s:
            log(f"generation budget reached after {k}/{len(batches)} batches")
            break
        ps = [prompts[i] for i, _ in bj]
        temps = torch.tensor([t for _, t in bj])
        for p, r, t in zip(ps, generate(model, ps, max_new_tokens, temps, eos_ids, gen), temps.tolist()):
            out["tokens"].append(torch.tensor(p + r, dtype=torch.int32))
            out["prompt_lens"].append(len(p))
            out["temps"].append(t)
            new += len(r)
        log(f"gen batch {k + 1}/{len(batches)} rows={len(bj)} new_tokens={new} t={time.time() - t0:.0f}s")
    return out


def generate_shards(model, prompts: list[list[int]], jobs: list[tuple[int, float]], done: set[int], out_dir,
                    tag: str, eos_ids: tuple[int, ...], batch: int = 2048, max_new_tokens: int = 640,
                    budget_s: float = 1e9, seed: int = 0, log=print, shard_bytes: int | None = None) -> dict:
    """Generate the jobs not in ``done`` into ``out_dir/shard-<tag>-<k>.npz`` files (each below
    ``shard_bytes``, default ``store.SHARD_BYTES``) until all are done or ``budget_s`` seconds
    would be exceeded by the next batch (estimated from the slowest batch so far; the first
    batch runs whenever budget_s > 0). Batches group
    similar prompt lengths; their order is shuffled with ``seed`` and each batch's sampling
    noise is seeded by (seed, its first job id). Returns {"shards": [paths], "jobs": n,
    "response_tokens": n, "seconds": s, "remaining": n}."""
    import pathlib

    from training.store import SHARD_BYTES, save_shard

    limit = (shard_bytes or SHARD_BYTES) // 2  # uint16 tokens per shard
    todo = sorted((j for j in range(len(jobs)) if j not in done), key=lambda j: (len(prompts[jobs[j][0]]), j))
    batches = [todo[i:i + batch] for i in range(0, len(todo), batch)]
    random.Random(seed).shuffle(batches)
    dev = model.lm_head.weight.device
    cur = {"seqs": [], "plens": [], "temps": [], "ids": []}
    shards, t0, slowest, new, n_jobs = [], time.time(), 0.0, 0, 0

    def flush():
        if cur["ids"]:
            path = pathlib.Path(out_dir) / f"shard-{tag}-{len(shards):03d}.npz"
            save_shard(path, cur["seqs"], cur["plens"], cur["temps"], cur["ids"],
                       {"tag": tag, "max_new_tokens": max_new_tokens, "seed": seed, "dtype": str(model.lm_head.weight.dtype),
                        "device": str(dev)})
            shards.append(str(path))
            log(f"wrote {path} ({len(cur['ids'])} sequences, {sum(map(len, cur['seqs']))} tokens)")
            for v in cur.values():
                v.clear()

    for k, bj in enumerate(batches):
        if budget_s <= 0 or (k and time.time() - t0 + 1.1 * slowest > budget_s):
            log(f"generation budget reached after {k}/{len(batches)} batches")
            break
        tb = time.time()
        ps = [prompts[jobs[j][0]] for j in bj]
        temps = torch.tensor([jobs[j][1] for j in bj])
        gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + bj[0])
        outs = generate(model, ps, max_new_tokens, temps, eos_ids, gen)
        if sum(map(len, cur["seqs"])) + sum(len(p) + len(r) for p, r in zip(ps, outs)) > limit:
            flush()
        for j, p, r in zip(bj, ps, outs):
            cur["seqs"].append(p + r)
            cur["plens"].append(len(p))
            cur["temps"].append(jobs[j][1])
            cur["ids"].append(j)
            new += len(r)
        n_jobs += len(bj)
        slowest = max(slowest, time.time() - tb)
        log(f"gen batch {k + 1}/{len(batches)} rows={len(bj)} prompt_len<={max(map(len, ps))} new_tokens={new} "
            f"t={time.time() - t0:.0f}s ({new / (time.time() - t0):.0f} tok/s)")
    flush()
    return {"shards": shards, "jobs": n_jobs, "response_tokens": new, "seconds": round(time.time() - t0, 1),
            "remaining": len(todo) - n_jobs}


def trim_loops(seq: torch.Tensor, prompt_len: int, n: int = 16, repeats: int = 2) -> torch.Tensor:
    """``seq`` [L] cut where its response falls into a loop: at the start of the first
    response n-gram (wholly inside the response) seen for the (repeats+1)-th time, keeping at least n
    response tokens. Greedy SmolLM2-135M responses often repeat until the length cap (session
    3: 58 % of 8-grams repeated); keeping ``repeats`` copies leaves the drafter some copying to
    learn without spending most anchors on it."""
    toks = seq[prompt_len:].tolist()
    seen: dict[tuple, int] = {}
    for k in range(len(toks) - n + 1):
        g = tuple(toks[k:k + n])
        seen[g] = seen.get(g, 0) + 1
        if seen[g] > repeats:
            return seq[:prompt_len + max(k, n)]
    return seq
