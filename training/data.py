"""Self-distillation data: the target regenerates responses to the training prompts
(plans/0002): every prompt once greedy, plus a sampled response (T ∈ U[t_lo, t_hi]) for a share
of them, chat template already in the prompt ids. Stored as a dict of lists of int32 tensors."""
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
