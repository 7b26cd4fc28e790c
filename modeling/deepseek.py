"""DeepSeek-V3 / Kimi-K2 target forward: MLA over a latent cache, sigmoid-routed MoE.

Follows the DeepSeek-V3 technical report (arXiv 2412.19437, §2.1 MLA, §2.1.2 MoE routing) with
the HF checkpoint layout (parameter names equal the checkpoint's tensor names). Attention is
computed in the absorbed form over the MLA latent cache (plans/0007-mla-tp.md has the algebra).
Same interface as ``modeling.llama.LlamaModel``: ``model(tokens, positions, cache, mask, taps)``,
``model.logits``, ``model.new_cache``.

Shapes: T = new tokens, S = visible key rows, H = hidden, h = heads, C = kv_lora_rank,
R = qk_rope_head_dim, N = qk_nope_head_dim, Dv = v_head_dim.
"""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from modeling.layers import RMSNorm, SwiGLU

MODEL_TYPES = ("deepseek_v3", "kimi_k2")


@dataclass(frozen=True)
class DeepseekConfig:
    """Hyper-parameters with HF ``DeepseekV3Config`` names. ``rope_scaling``: the YaRN dict of
    the checkpoint's config.json (``factor``, ``original_max_position_embeddings``,
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``) or None."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    max_position_embeddings: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    model_type: str = "deepseek_v3"
    name: str = "deepseek_v3"
    fp8_block: tuple[int, int] = (128, 128)  # quantization_config.weight_block_size

    def __post_init__(self):
        """Raises ValueError naming the config.json field that is not a usable value."""
        def need(name, ok, what):
            if not ok(getattr(self, name)):
                raise ValueError(f"config.json's {name} must be {what}, got {getattr(self, name)!r}")

        def is_int(v, low):
            return type(v) is int and v >= low

        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_group",
                     "topk_group", "max_position_embeddings"):
            need(name, lambda v: is_int(v, 1), "a positive int")
        for name in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace"):
            need(name, lambda v: is_int(v, 0), "an int >= 0")
        need("q_lora_rank", lambda v: v is None or is_int(v, 1), "null or a positive int")
        need("qk_rope_head_dim", lambda v: is_int(v, 2) and v % 2 == 0, "an even positive int (rotated in pairs)")
        if self.n_routed_experts and self.first_k_dense_replace < self.num_hidden_layers:
            need("num_experts_per_tok", lambda v: is_int(v, 1), "a positive int (the model has MoE layers)")
        need("eos_token_ids", lambda v: all(is_int(t, 0) for t in v), "token ids (ints)")
        need("fp8_block", lambda v: len(v) == 2 and all(is_int(b, 1) for b in v),
             "two positive ints (quantization_config.weight_block_size)")
        if self.rope_scaling is not None:
            lacking = [k for k in ("factor", "original_max_position_embeddings") if k not in self.rope_scaling]
            if lacking:
                raise ValueError(f"config.json's rope_scaling (yarn) lacks {lacking}")
        E, G = self.n_routed_experts, self.n_group
        if E % G or not 1 <= self.topk_group <= G or self.num_experts_per_tok > E // G * self.topk_group:
            raise ValueError(f"router config: {E} experts in {G} groups, top-{self.topk_group} groups, "
                             f"top-{self.num_experts_per_tok} experts is not satisfiable")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_key_value_heads(self) -> int:
        """For sizing a fresh DFlash drafter (modeling.defaults.drafter_config): MLA has no KV
        heads of its own; a drafter gets as many as query heads."""
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """For sizing a fresh drafter: the value head dim."""
        return self.v_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-½ · mscale(factor, mscale_all_dim)² (YaRN attention temperature)."""
        s = self.qk_head_dim ** -0.5
        y = self.rope_scaling or {}
        if y.get("mscale_all_dim"):
            m = _yarn_mscale(y["factor"], y["mscale_all_dim"])
            s *= m * m
        return s

    @classmethod
    def from_dict(cls, c: dict, name: str = "") -> "DeepseekConfig":
        """From a config.json dict. Raises ValueError for an unsupported model_type/router."""
        mt = c.get("model_type", "deepseek_v3")
        if mt not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {mt!r}")
        if c.get("scoring_func", "sigmoid") != "sigmoid" or c.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"only sigmoid scoring with noaux_tc top-k is supported, got "
                             f"{c.get('scoring_func')!r}/{c.get('topk_method')!r}")
        if c.get("moe_layer_freq", 1) != 1 or c.get("attention_bias", False):
            raise ValueError(f"unsupported: moe_layer_freq {c.get('moe_layer_freq')} (need 1), "
                             f"attention_bias {c.get('attention_bias')} (need false)")
        rs = c.get("rope_scaling") or c.get("rope_parameters") or {}
        kind = rs.get("type", rs.get("rope_type", "default"))
        if kind not in ("yarn", "default"):
            raise ValueError(f"rope_scaling type must be yarn (or none), got {rs}")
        rs = rs if kind == "yarn" else None
        eos = c.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        lacking = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                               "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                               "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok") if k not in c]
        if lacking:
            raise ValueError(f"config.json lacks {lacking}")

        def opt(key, default):  # null → the default; any other value is checked (0 is not rewritten)
            return default if c.get(key) is None else c[key]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            moe_intermediate_size=c["moe_intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"], q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
            n_routed_experts=c["n_routed_experts"], num_experts_per_tok=c["num_experts_per_tok"],
            n_group=opt("n_group", 1), topk_group=opt("topk_group", 1),
            n_shared_experts=opt("n_shared_experts", 0), first_k_dense_replace=opt("first_k_dense_replace", 0),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(c.get("rope_theta", (rs or {}).get("rope_theta", 10000.0))),
            rope_scaling=dict(rs) if rs else None, tie_word_embeddings=c.get("tie_word_embeddings", False),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, model_type=mt, name=name or mt,
            fp8_block=tuple((c.get("quantization_config") or {}).get("weight_block_size", (128, 128))),
        )

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "DeepseekConfig":
        path = pathlib.Path(path)
        return cls.from_dict(json.loads((path / "config.json").read_text()), name=path.name)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_inv_freq(cfg: DeepseekConfig) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies [R/2] float32 and the cos/sin multiplier (YaRN, Peng et al.
    2023, §3: NTK-by-parts ramp between beta_fast and beta_slow rotations over the original
    context; the correction range is floored/ceiled as DeepSeek's reference code does)."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    extra = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d)
    y = cfg.rope_scaling
    if not y:
        return extra, 1.0
    factor, orig = float(y["factor"]), y["original_max_position_embeddings"]
    fast, slow = y.get("beta_fast") or 32, y.get("beta_slow") or 1

    def dim_of(rot):  # the dimension whose wavelength makes `rot` rotations over `orig` positions
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency, unchanged); 0: interpolate (÷ factor)
    inv = (extra / factor) * (1 - keep) + extra * keep
    if y.get("mscale") and y.get("mscale_all_dim"):  # 1 when equal (both real configs)
        attn = _yarn_mscale(factor, y["mscale"]) / _yarn_mscale(factor, y["mscale_all_dim"])
    else:
        attn = _yarn_mscale(factor)
    return inv, attn


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [T, ..., R] by cos/sin [T, R/2]; the output
    keeps the interleaved layout (q and k alike, so their dot products are those of the
    checkpoint's convention)."""
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[-1]]
    c, s = cos.view(shape), sin.view(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)


class MLACache:
    """MLA latent cache of one request: ``kv`` [layers, capacity, C + R] holding c ‖ k_pe per
    token (shared by all heads). Rows [0, length) are committed; a forward writes its rows at
    [length, length + T) uncommitted. Same contract as ``modeling.kv_cache.KVCache``."""

    def __init__(self, layers: int, capacity: int, width: int, device, dtype):
        self.kv = torch.zeros(layers, capacity, width, device=device, dtype=dtype)
        self.capacity, self.length, self.base = capacity, 0, 0

    def write(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Write latent [T, C + R] after the committed rows; return the visible rows
        [length + T, C + R]. Raises ValueError past capacity."""
        end = self.length + latent.shape[0]
        if end > self.capacity:
            raise ValueError(f"KV rows {end} exceed capacity {self.capacity}")
        self.kv[layer, self.length:end] = latent
        return self.kv[layer, :end]

    def commit(self, rows: torch.Tensor) -> None:
        """Gather pending rows at offsets ``rows`` [n] (ascending, relative to ``length``) to
        [length, length + n); the rest are dropped."""
        n = int(rows.numel())
        src = rows.to(self.kv.device) + self.length
        self.kv[:, self.length:self.length + n] = self.kv[:, src]
        self.length += n

    @property
    def rows_held(self) -> int:
        """KV rows this cache keeps reserved in the target's pool accounting (its capacity)."""
        return self.capacity

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


def mla_attend(q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor | None, scale: float,
               C: int) -> torch.Tensor:
    """Absorbed MLA attention (multi-query over the latent). q [T, h, C + R] = q_lat ‖ q_pe;
    latent [S, C + R] = c ‖ k_pe; mask [T, S] bool (True = visible) or None. Returns the
    latent output o_lat [T, h, C] (before W_UV). Scores and softmax in float32."""
    scores = torch.einsum("thk,sk->ths", q.float(), latent.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("ths,sc->thc", scores.softmax(-1), latent[:, :C].float()).to(q.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention with q LoRA and decoupled RoPE (DeepSeek-V2 §2.1)."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.cfg = cfg
        H, h = cfg.hidden_size, cfg.num_attention_heads
        self.h, self.C, self.R, self.N, self.Dv = h, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(H, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.C + self.R, bias=False)
        self.kv_a_layernorm = RMSNorm(self.C, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.C, h * (self.N + self.Dv), bias=False)
        self.o_proj = nn.Linear(h * self.Dv, H, bias=False)
        self.scale = cfg.softmax_scale

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, N, C] and W_UV [h, Dv, C] (views of kv_b_proj.weight)."""
        w = self.kv_b_proj.weight.view(self.h, self.N + self.Dv, self.C)
        return w[:, :self.N], w[:, self.N:]

    def project(self, x, cos, sin):
        """x [T, H] → absorbed queries [T, h, C + R] and the new latent rows [T, C + R]."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.cfg.q_lora_rank else self.q_proj(x)
        q = q.view(T, self.h, self.N + self.R)
        q_lat = self.absorb_q(q[..., :self.N])                                 # [T, h, C]
        q_pe = rope_interleaved(q[..., self.N:], cos, sin)                     # [T, h, R]
        ckv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat([self.kv_a_layernorm(ckv[:, :self.C]), rope_interleaved(ckv[:, self.C:], cos, sin)], -1)
        return torch.cat([q_lat, q_pe], -1), latent

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, h, N] → q_nope·W_UK per head [T, h, C]."""
        return torch.einsum("thn,hnc->thc", q_nope, self.absorbed()[0])

    def expand_v(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, h, C] → W_UV·o_lat per head [T, h, Dv]."""
        return torch.einsum("thc,hvc->thv", o_lat, self.absorbed()[1])

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, h, C] → W_UV per head → o_proj → [T, H]."""
        return self.o_proj(self.expand_v(o_lat).flatten(1))

    def forward(self, x, cos, sin, cache: MLACache, layer: int, mask):
        """mask: [T, L + T] bool, or an attention object (``KernelAttention``; ``modeling.mla_batch.MLABatch``)
        that runs the Triton kernel."""
        q, latent = self.project(x, cos, sin)
        visible = cache.write(layer, latent)
        if not isinstance(mask, torch.Tensor):
            return self.output(mask(q, cache.kv[layer], self.scale, self.C))
        return self.output(mla_attend(q, visible, mask, self.scale, self.C))


class KernelAttention:
    """Inputs of ``specdec_kernels.mla_attention`` for one forward, derived from the engine's mask
    [T, L + T] (all prefix rows visible, then a causal or tree visibility mask among the T
    rows, parents before children): a row's visible new rows in ascending order are its
    ancestors by depth. No host sync (L and T are host ints); the kernel's tile table is built
    on the first call (per head count) and reused, so later calls can be captured in a CUDA graph."""

    def __init__(self, positions: torch.Tensor, mask: torch.Tensor, L: int):
        T = mask.shape[0]
        cols = torch.arange(T, device=mask.device).expand(T, T)
        self.ancestors = torch.where(mask[:, L:], cols, T).sort(-1).values.to(torch.int32)  # [T, T]
        self.positions, self.L, self.T = positions, L, T
        self._tiles: dict[int, torch.Tensor] = {}

    def __call__(self, q, kv, scale, C):
        from specdec_kernels.mla_attention import default_block_r, make_tiles, mla_attention

        seqs = [(0, self.T, 0, self.L)]
        h = q.shape[1]
        if h not in self._tiles:  # a host → device copy: not inside a graph capture
            self._tiles[h] = make_tiles(seqs, default_block_r(h), q.device)
        return mla_attention(q, kv, self.positions, self.ancestors, seqs, scale, C, max_positions=self.L + self.T,
                             tiles=self._tiles[h])


class MoE(nn.Module):
    """Routed experts with sigmoid scores, selection-only correction bias, group-limited top-k
    and routed scaling, plus shared experts (DeepSeek-V3 §2.1.2, auxiliary-loss-free balancing)."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        if cfg.n_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → [T, E] float32 (the router runs in fp32 whatever the model's dtype)."""
        return F.linear(x.float(), self.gate.weight.float())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (expert ids [T, k] int64, weights [T, k] float32)."""
        c = self.cfg
        scores = self.router_logits(x).sigmoid()                               # [T, E]
        choice = scores + self.gate.e_score_correction_bias.float()
        T, E, G = x.shape[0], c.n_routed_experts, c.n_group
        if c.topk_group < G:  # group-limited (DeepSeek-V3: 4 of 8); Kimi-K2's one group keeps every expert
            group = choice.view(T, G, E // G).topk(min(2, E // G), -1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(c.topk_group, -1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // G, 1), float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, -1).indices
        w = scores.gather(1, ids)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out + self.shared_experts(x) if self.cfg.n_shared_experts else out

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → the routed experts' weighted sum [T, H] in x.dtype (each token's experts added in
        ascending id, in float32), one expert at a time."""
        ids, w = self.route(x)
        k = ids.shape[1]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # (token, slot) pairs grouped by expert (stable: ascending token within an expert); one
        # host sync for the group sizes instead of one per expert
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.cfg.n_routed_experts).tolist()
        start = 0
        for e, n in enumerate(counts):  # ascending expert id: a token's sum order is its own
            if n:
                pair = order[start:start + n]
                tok, slot = pair // k, pair % k
                # a token picks an expert at most once, so tok is unique here (and on this CPU
                # torch index_add_ costs ~60 ms per call, 1000× this)
                out[tok] += self.experts[e](x[tok]).float() * w[tok, slot, None]
                start += n
        return out.to(x.dtype)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if index >= cfg.first_k_dense_replace else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekModel(nn.Module):
    """Target model; parameter names equal DeepSeek-V3 / Kimi-K2 HF checkpoint names."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq, self.rope_mult = yarn_inv_freq(cfg)  # float32, kept off the module's dtype
        self.attention = "torch"  # or "triton": specdec_kernels.mla_attention (row-invariant, tree-aware)

    def to(self, *args, **kwargs):
        """As nn.Module.to, but the router (weights and correction bias) stays float32: expert
        selection must not depend on the compute dtype."""
        moes = [m for m in self.modules() if isinstance(m, MoE)]
        kept = [(m.gate.weight.data.float(), m.gate.e_score_correction_bias.float()) for m in moes]
        super().to(*args, **kwargs)
        device = self.lm_head.weight.device
        if device.type != "meta":  # float32 on the compute device: no copy inside a CUDA graph
            self.inv_freq = self.inv_freq.to(device)
        for m, (w, b) in zip(moes, kept):
            m.gate.weight.data = w.to(device)
            m.gate.e_score_correction_bias = b.to(device)
        return self

    def new_cache(self, capacity: int) -> MLACache:
        p = self.lm_head.weight
        return MLACache(self.cfg.num_hidden_layers, capacity, self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim,
                        p.device, p.dtype)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R/2] for absolute positions [T] (YaRN frequencies, × the YaRN multiplier)."""
        ang = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (ang.cos() * self.rope_mult).to(dtype), (ang.sin() * self.rope_mult).to(dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: MLACache,
                mask: torch.Tensor, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T new tokens against the committed latent rows and write theirs (uncommitted).

        tokens, positions: [T] int64; mask: [T, cache.length + T] bool (True = visible), or (row-invariant
        model) an ``modeling.mla_batch.MLABatch`` passed as both cache and mask;
        taps: ascending decoder-layer indices whose output (residual stream after layer k) is
        returned. Returns (final-normed hidden [T, H], features [T, len(taps)·H] or None)."""
        if list(taps) != sorted(set(taps)) or (taps and not 0 <= taps[0] <= taps[-1] < self.cfg.num_hidden_layers):
            raise ValueError(f"taps must be ascending, distinct decoder layers in [0, {self.cfg.num_hidden_layers}), "
                             f"got {taps}")
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rope(positions, x.dtype)
        if self.attention == "triton" and isinstance(mask, torch.Tensor):
            mask = KernelAttention(positions, mask, cache.length)
        tapped = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, mask)
            if i in taps:
                tapped.append(x)
        return self.model.norm(x), (torch.cat(tapped, -1) if taps else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] → [T, V] float32."""
        return self.lm_head(hidden).float()
