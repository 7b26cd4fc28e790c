"""DFlash block-diffusion drafter (z-lab DFlash, arXiv 2602.06036; shared DOMAIN notes §2).

A few Qwen3-style layers (RMSNorm, attention with per-head q/k RMSNorm, SwiGLU), a final
RMSNorm, no embedding and no LM head of its own: the target's are borrowed. Tapped target
hidden states [n, L·H] are fused by ``fc`` + ``hidden_norm`` into context features; every
layer turns them into K/V rows with its own k/v projections (KV injection). Only the block
[bonus, MASK×(B−1)] produces queries; it is bidirectional inside itself and sees context rows
at earlier positions. The output at slot j ≥ 1 predicts the token at slot j's own position.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass

import torch
from torch import nn

from modeling.layers import RMSNorm, SwiGLU, apply_rope, attend, rope_cos_sin


def default_taps(num_target_layers: int, num_taps: int) -> list[int]:
    """DFlash default tapped layers: round(1 + i·(N−4)/(L−1)); one tap → N//2."""
    if num_taps == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_taps - 1)) for i in range(num_taps)]


#: the draft service's default draft context window (``--draft-window``), in rows: measured on the
#: H200 (bench/results/acceptance_context_h200_w*.md, session-5 drafter, 8 cuts x 128 tokens):
#: tree@64 τ at 2,048 / 7,936 prompt tokens 3.05 / 1.83 (en) with the full context, 3.94 / 3.96
#: with 512, 3.55 / 3.57 with 1,024 (zh and code alike); equal below 512 tokens
DEFAULT_DRAFT_WINDOW = 512


def window_start(length: int, window: int, unit: int) -> int:
    """First context position a block drafted after ``length`` context rows attends to under a
    draft context window of ``window`` rows (issue 9 item 4; 0 = no window): the start of the
    ``unit``-row page holding position length − window, so the block sees the last ≥ window
    rows (whole pages: fewer than window + unit), at their own absolute positions (RoPE, so
    relative distances stay < window + unit + block_size). 0 when window is 0 or ≥ length."""
    if window <= 0 or length <= window:
        return 0
    return (length - window) // unit * unit


@dataclass(frozen=True)
class DFlashConfig:
    """Drafter hyper-parameters; serialised as an HF config with a ``dflash_config`` block."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def to_json(self) -> dict:
        d = asdict(self)
        dflash = {k: d.pop(k) for k in ("target_layer_ids", "mask_token_id", "block_size")}
        dflash["target_layer_ids"] = list(dflash["target_layer_ids"])
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **d, "dflash_config": dflash}

    @classmethod
    def from_json(cls, d: dict) -> "DFlashConfig":
        dflash = d["dflash_config"]
        keys = {f for f in cls.__dataclass_fields__} - {"target_layer_ids", "mask_token_id", "block_size"}
        return cls(**{k: d[k] for k in keys if k in d},
                   target_layer_ids=tuple(dflash["target_layer_ids"]),
                   mask_token_id=int(dflash["mask_token_id"]), block_size=int(dflash["block_size"]))


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.h, self.g, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.g * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.g * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V rows [T, g, d] of inputs x [T, H] at rotary tables cos/sin [T, d]."""
        T = x.shape[0]
        k = apply_rope(self.k_norm(self.k_proj(x).view(T, self.g, self.d)), cos, sin)
        return k, self.v_proj(x).view(T, self.g, self.d)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Block rows x [T, H] attend to context rows ctx_k/ctx_v [S, g, d] and to themselves.
        mask [T, S + T] bool or None (all visible)."""
        T = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(T, self.h, self.d)), cos, sin)
        k, v = self.kv(x, cos, sin)
        return self.o_proj(attend(q, torch.cat([ctx_k, k]), torch.cat([ctx_v, v]), mask))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter's own weights (names follow published DFlash checkpoints: ``layers.*``,
    ``fc``, ``hidden_norm``, ``norm``). Embedding and LM head are passed in (the target's)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        n_taps = len(c.target_layer_ids)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(n_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context K/V per layer for tapped target features [n, L·H] at positions [n] int64:
        fused by fc + hidden_norm, then each layer's k/v projections (+k_norm, +RoPE)."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None = None) -> torch.Tensor:
        """Block (or several blocks) embeddings [T, H] at positions [T] → final-normed hidden
        [T, H]. ctx_kv: per layer (k, v) [S, g, d]; mask [T, S + T] bool or None."""
        x = block_embeds
        cos, sin = self.rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def save(self, directory: str | pathlib.Path, shard_bytes: int = 16 * 2 ** 20) -> None:
        """Write config.json + safetensors shards of at most ``shard_bytes`` with an index."""
        from safetensors.torch import save_file

        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_json(), indent=2))
        shards, cur, size = [], {}, 0
        for name, t in self.state_dict().items():
            t = t.detach().cpu().contiguous()
            if cur and size + t.nbytes > shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[name] = t
            size += t.nbytes
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))

    @classmethod
    def load(cls, directory: str | pathlib.Path) -> "DFlashDrafter":
        """Load a published-layout checkpoint (config.json with dflash_config + safetensors)."""
        from safetensors.torch import load_file

        directory = pathlib.Path(directory)
        cfg = DFlashConfig.from_json(json.loads((directory / "config.json").read_text()))
        model = cls(cfg)
        state = {}
        for f in sorted(directory.glob("*.safetensors")):
            state.update(load_file(str(f)))
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return model

    @classmethod
    def random(cls, c: DFlashConfig, seed: int = 0) -> "DFlashDrafter":
        """A randomly initialised drafter with a fixed seed (used until a trained one exists)."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            return cls(c)
        finally:
            torch.random.set_rng_state(gen_state)
