"""AdamW with bf16 moments and optional bf16 master weights (plans/0008).

Moments live in bf16 during training (not only on disk), so a saved state restores bitwise and
a resumed run continues exactly as an uninterrupted one. With bf16 parameters (the serving
dtype) each update is computed in float32 and stochastically rounded to bf16 (unbiased: a
value between two bf16 neighbours rounds up with probability equal to its fractional
distance), so updates far below half a bf16 ulp are not lost on average. AdamW as in
Loshchilov & Hutter 2019 (decoupled weight decay, bias-corrected moments).
"""
from __future__ import annotations

import torch


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """float32 x → bf16, rounding each element up or down at random in proportion to its
    distance from the two bf16 neighbours: add uniform noise to the 16 low bits, truncate."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, device=bits.device, dtype=torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamW16:
    """AdamW over ``params`` (fp32 or bf16 tensors with .grad) with bf16 moments m, v.
    step(lr) applies one update, each parameter at lr × its ``lr_scales`` entry (default 1: e.g.
    layers grown onto a trained drafter learn faster than the trained ones);
    ``state_tensors``/``load_state_tensors`` (de)serialise it (moments, step count and the
    stochastic-rounding generator state; the scales are configuration, kept by the caller)."""

    def __init__(self, params, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.01, seed: int = 0,
                 lr_scales: list[float] | None = None):
        self.params = list(params)
        self.lr_scales = list(lr_scales) if lr_scales is not None else [1.0] * len(self.params)
        assert len(self.lr_scales) == len(self.params)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.m = [torch.zeros_like(p, dtype=torch.bfloat16) for p in self.params]
        self.v = [torch.zeros_like(p, dtype=torch.bfloat16) for p in self.params]
        self.t = 0
        dev = self.params[0].device
        self.gen = torch.Generator(device=dev).manual_seed(seed)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        base = lr
        for p, m, v, scale in zip(self.params, self.m, self.v, self.lr_scales):
            if p.grad is None:
                continue
            lr = base * scale
            g = p.grad.float()
            m32 = m.float().mul_(b1).add_(g, alpha=1 - b1)
            v32 = v.float().mul_(b2).addcmul_(g, g, value=1 - b2)
            m.copy_(m32)
            v.copy_(v32)
            new = p.float() * (1 - lr * self.weight_decay) - lr * (m32 / c1) / ((v32 / c2).sqrt() + self.eps)
            p.copy_(stochastic_round_bf16(new, self.gen) if p.dtype == torch.bfloat16 else new)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"m.{i}": m for i, m in enumerate(self.m)}
        out.update({f"v.{i}": v for i, v in enumerate(self.v)})
        out["t"] = torch.tensor([self.t], dtype=torch.int64)
        out["gen"] = self.gen.get_state()
        return out

    def load_state_tensors(self, s: dict[str, torch.Tensor]) -> None:
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            m.copy_(s[f"m.{i}"])
            v.copy_(s[f"v.{i}"])
        self.t = int(s["t"][0])
        self.gen.set_state(s["gen"].cpu())
