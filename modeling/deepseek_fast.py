"""Row-invariant DeepSeek-V3 / Kimi-K2 forward: the same ``DeepseekModel`` with every matmul,
norm and the attention routed through fixed-order Triton kernels (plans/0006 for the idea,
plans/0007 for MLA), so a row's logits are bitwise independent of the rows beside it and of
the tree's shape: a greedy tree verify picks exactly what one-row decodes would, in bf16 too.

What is routed where: every ``nn.Linear`` (q_a, q_b, kv_a, o_proj, experts, shared experts,
dense MLP, LM head) → ``specdec_kernels.matmul.linear`` (one tile config for every M; routed experts' outside
``specdec_kernels.moe`` in that kernel's K blocks and split-K runs: ``specdec_kernels.moe.loop_tiles``); the per-head
W_UK / W_UV absorption → the same kernel's per-head form (``head_linear``: one launch for every
head, each head's weights read once); the router → ``specdec_kernels.router`` (float32 logits, then the selection in one launch); every RMSNorm → ``specdec_kernels.rmsnorm_rows``;
silu(gate)·up → ``specdec_kernels.swiglu``, after one projection through a stacked [gate; up] weight (shared experts,
dense MLPs: ``stack_gate_up_``; the shared expert's down projection adds the routed experts' sum as its
residual); the MLA projection's epilogue (RoPE of q_pe and k_pe, the latent RMSNorm, the concatenations)
→ ``specdec_kernels.mla_project``; attention → ``specdec_kernels.mla_attention``; the routed experts of a
layer whose experts are plain ``nn.Linear`` → ``specdec_kernels.moe`` (all the experts a batch touches in
three launches; their weights re-homed once into two stacked tensors that the experts' Linears
then view, so no extra memory), else (FP8 weights kept) the per-expert loop. Expert outputs are
added to a token's sum in ascending expert id, which depends on the token alone. The remaining
torch ops are elementwise (the residual adds, the rotary table): uniform per element on a GPU;
on a CPU, vectorised torch math can round a value by its offset in the tensor, so the CPU
tests keep row widths multiples of the vector width (the SwiGLU silu was not, hence its
kernel). Eager (no CUDA graphs yet): host syncs remain in the per-expert loop (not in ``specdec_kernels.moe``).
"""
from __future__ import annotations

import types

import torch
from torch import nn

from specdec_kernels.matmul import head_linear, linear
from specdec_kernels.mla_project import mla_project
from specdec_kernels.moe import loop_tiles, moe_experts
from specdec_kernels.router import route, router_logits
from specdec_kernels.rmsnorm_rows import rmsnorm
from specdec_kernels.swiglu import swiglu
from modeling.deepseek import DeepseekModel, MLAttention, MoE
from modeling.deepseek_weights import FP8Linear
from modeling.layers import RMSNorm, SwiGLU


def _linear_forward(self, x):
    shape = x.shape
    return linear(x.reshape(-1, shape[-1]), self.weight).view(*shape[:-1], -1)


def _expert_linear_forward(self, x):
    """A routed expert's projection outside specdec_kernels.moe (the per-expert loop): K folded as that kernel
    does (``self._tiles`` = ``specdec_kernels.moe.loop_tiles``: its BK and split-K count) — whatever the
    shape's linear tiling — so both paths agree."""
    shape = x.shape
    return linear(x.reshape(-1, shape[-1]), self.weight, tiles=self._tiles).view(*shape[:-1], -1)


def _lm_head_forward(self, x):  # fp32 logits: no bf16 rounding before the argmax
    return linear(x, self.weight, out_dtype=torch.float32)


def _rmsnorm_forward(self, x):
    shape = x.shape
    return rmsnorm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)


def stack_gate_up_(mlp: SwiGLU) -> bool:
    """Re-home a SwiGLU's gate and up weights [I, H] into one ``mlp._w13`` [2I, H] (gate rows, then up
    rows), the two Linears' weights becoming views of it (no extra memory): one projection instead of
    two, and no concatenation before ``specdec_kernels.swiglu``. False (nothing changed) unless both are plain
    ``nn.Linear`` of one shape, dtype and device."""
    g, u = mlp.gate_proj, mlp.up_proj
    if type(g) is not nn.Linear or type(u) is not nn.Linear or g.weight.shape != u.weight.shape \
            or g.weight.dtype != u.weight.dtype or g.weight.device != u.weight.device:
        return False
    w13 = torch.cat([g.weight.data, u.weight.data])
    g.weight.data, u.weight.data = w13[:g.out_features], w13[g.out_features:]
    mlp._w13 = w13
    return True


def _swiglu_act(self, x):
    """silu(gate(x)) · up(x) [M, I] of x [M, H]: one projection through the stacked weight where there is
    one (``stack_gate_up_``), else two and a concatenation (routed experts; FP8 weights)."""
    w13, g, u = getattr(self, "_w13", None), self.gate_proj, self.up_proj  # None: a routed expert (stacked per MoE)
    if w13 is not None and not (type(g) is nn.Linear and type(u) is nn.Linear and g.weight.data_ptr() == w13.data_ptr()
                                and u.weight.data_ptr() == w13[g.out_features:].data_ptr()):
        # the weights were replaced since stacking (load_state_dict(assign=True), .to(), p.data = …): stack
        # them again, or (no longer two plain Linears) project twice — never read stale weights
        if not stack_gate_up_(self):
            self._w13 = None
    if self._w13 is None:  # (specdec_kernels.swiglu: a CPU torch silu rounds by tensor offset)
        return swiglu(torch.cat([self.gate_proj(x), self.up_proj(x)], -1))
    return swiglu(linear(x, self._w13))


def _swiglu_forward(self, x):
    shape = x.shape
    return self.down_proj(_swiglu_act(self, x.reshape(-1, shape[-1]))).view(*shape[:-1], -1)


def _project(self, x, cos, sin):  # as MLAttention.project; its epilogue in one launch (specdec_kernels/mla_project.py)
    T = x.shape[0]
    q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.cfg.q_lora_rank else self.q_proj(x)
    q = q.view(T, self.h, self.N + self.R)
    return mla_project(q, self.absorb_q(q[..., :self.N]), self.kv_a_proj_with_mqa(x), self.kv_a_layernorm.weight,
                       self.kv_a_layernorm.eps, cos, sin)


def absorb_weights_(m: MLAttention) -> None:
    """(Re)build ``m``'s absorbed weights from kv_b_proj for ``specdec_kernels.matmul.head_linear``: W_UK^T
    ``m._w_uk`` [h, C, N] and W_UV ``m._w_uv`` [h, Dv, C] (contiguous copies, 1× kv_b's bytes: its FP8
    form is dequantised once here, not per call); remembers which kv_b tensor (and version) they came
    from (``_absorbed_current``)."""
    srcs = _absorb_sources(m)
    w_uk, w_uv = m.absorbed()
    m._w_uk = w_uk.transpose(1, 2).contiguous()
    m._w_uv = w_uv.contiguous()
    m._absorbed_from = _absorb_key(srcs)
    # the sources' storages are held, so a replaced tensor's address cannot be reused by its replacement
    # (that would hide the change from the pointer check); the old storage lives until the next rebuild
    m._absorbed_keep = [t.untyped_storage() for t in srcs]


def _version(t: torch.Tensor) -> int:  # in-place writes bump it; an inference tensor has none (-1)
    try:
        return t._version
    except RuntimeError:
        return -1


def _absorb_sources(m: MLAttention) -> tuple[torch.Tensor, ...]:  # kv_b's stored tensors (FP8Linear: bytes, scales)
    lin = m.kv_b_proj
    return (lin.w_u8, lin.scale_inv) if isinstance(lin, FP8Linear) else (lin.weight,)


def _absorb_key(srcs) -> tuple:
    return tuple((t.data_ptr(), _version(t)) for t in srcs)


def _absorbed_current(m: MLAttention) -> None:
    """Rebuild the absorbed weights if kv_b_proj's tensors (FP8: bytes and block scales) were replaced (.to(),
    p.data = …) or written in place since (copy_, mul_ …) — load_state_dict is seen either way, by a hook: never
    attend with stale ones. Not seen: in-place writes through ``p.data`` (it has its own version counter) or to
    an inference tensor (none) — call ``absorb_weights_`` after those."""
    if _absorb_key(_absorb_sources(m)) != m._absorbed_from:
        absorb_weights_(m)


def _absorb_q(self, q_nope):  # [T, h, N] (a strided view of q) → [T, h, C]: one launch for every head
    _absorbed_current(self)
    return head_linear(q_nope, self._w_uk)


def _expand_v(self, o_lat):  # [T, h, C] → [T, h, Dv]
    _absorbed_current(self)
    return head_linear(o_lat, self._w_uv)


def _router_logits(self, x):  # float32 on CUDA cores, one fixed blocking (specdec_kernels/router.py)
    return router_logits(x, self.gate.weight.float())


def _route(self, x):  # the logits, then sigmoid, bias, group limit, top-k and weights in one launch
    c = self.cfg
    return route(self.router_logits(x), self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                 c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)


def stack_experts_(moe: MoE) -> bool:
    """Re-home the routed experts' weights into ``moe._w13`` [E, 2I, H] (gate rows, then up rows)
    and ``moe._w2`` [E, H, I], each expert's Linear weights becoming views of them (the old
    tensors are freed: no extra memory). Experts kept in FP8 (``FP8Linear``) are stacked as their
    bytes, with their block scales in ``moe._moe_scales`` (gate grid then up grid [E, 2·rows, cols];
    down [E, rows, cols]) and ``moe._moe_block``; plain ones leave ``_moe_scales`` None. False
    (nothing changed) unless every expert is of one kind (all ``nn.Linear``, or all ``FP8Linear``
    with one block shape), on one device and of one dtype."""
    lins = [(x.gate_proj, x.up_proj, x.down_proj) for x in moe.experts]
    flat = [lin for trio in lins for lin in trio]
    kinds = {type(lin) for lin in flat}
    if kinds == {nn.Linear}:
        ws = [(lin.weight,) for lin in flat]
    elif kinds == {FP8Linear} and len({lin.block for lin in flat}) == 1 and len({lin.dtype for lin in flat}) == 1:
        ws = [(lin.w_u8, lin.scale_inv) for lin in flat]
    else:
        return False
    if len({(t.dtype, t.device) for w in ws for t in w[:1]}) != 1:
        return False
    gate, _, down = ws[0], ws[1], ws[2]
    E, inter = len(lins), gate[0].shape[0]
    stacked = [torch.empty(E, 2 * gate[i].shape[0], *gate[i].shape[1:], dtype=gate[i].dtype, device=gate[i].device)
               for i in range(len(gate))]                       # w13 (and s13): gate rows then up rows
    downs = [torch.empty(E, *down[i].shape, dtype=down[i].dtype, device=down[i].device) for i in range(len(down))]
    names = ("weight",) if kinds == {nn.Linear} else ("w_u8", "scale_inv")
    for e, (g, u, d) in enumerate(lins):
        for i, name in enumerate(names):
            rows = gate[i].shape[0]
            stacked[i][e, :rows].copy_(getattr(g, name).data)
            stacked[i][e, rows:].copy_(getattr(u, name).data)
            downs[i][e].copy_(getattr(d, name).data)
            if name == "weight":  # parameters: swap their data; buffers: assign the views
                g.weight.data, u.weight.data, d.weight.data = stacked[i][e, :rows], stacked[i][e, rows:], downs[i][e]
            else:
                setattr(g, name, stacked[i][e, :rows])
                setattr(u, name, stacked[i][e, rows:])
                setattr(d, name, downs[i][e])
    moe._w13, moe._w2 = stacked[0], downs[0]
    moe._moe_scales = (stacked[1], downs[1]) if len(names) == 2 else None
    moe._moe_block = lins[0][0].block if len(names) == 2 else (128, 128)
    return True


def _moe_forward(self, x):  # routed experts grouped (specdec_kernels.moe), then the shared experts
    first = self.experts[0].gate_proj
    if (first.w_u8 if self._moe_scales is not None else first.weight).data_ptr() != self._w13.data_ptr():
        # the experts' tensors were replaced since stacking (load_state_dict(assign=True), .to(), p.data = …):
        # stack them again, or (no longer one kind) run the per-expert loop — never read stale weights. (Seen
        # on expert 0: one other expert's tensor replaced alone is not — run row_invariant_ again after that.)
        if not stack_experts_(self):
            return moe_loop(self, x)
    ids, w = self.route(x)
    return _add_shared(self, x, moe_experts(x, self._w13, self._w2, ids, w, scales=self._moe_scales,
                                            block=self._moe_block))


def _add_shared(moe: MoE, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + the shared experts of x [T, H]: their down projection takes the routed sum as its
    residual (one rounding, no separate add). The shared module's forward (and any hook on it; tensor
    parallel hooks layer.mlp, the whole sum) is not called."""
    if not moe.cfg.n_shared_experts:
        return routed
    shared = moe.shared_experts
    return linear(_swiglu_act(shared, x), shared.down_proj.weight, residual=routed)


def moe_loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The row-invariant MoE one routed expert at a time (``MoE.routed`` over the switched Linears) plus the
    shared experts as the grouped path adds them: bitwise what ``specdec_kernels.moe`` gives (x [T, H] → [T, H])."""
    return _add_shared(moe, x, MoE.routed(moe, x))


def row_invariant_modules_(root: nn.Module) -> nn.Module:
    """Switch every Linear, RMSNorm, SwiGLU, MLA attention and MoE under ``root`` (in place) to the
    row-invariant kernels (``row_invariant_`` for a whole model; a lone decoder layer for benches)."""
    routed = {id(e) for moe in root.modules() if isinstance(moe, MoE) for e in moe.experts}
    for m in root.modules():
        if isinstance(m, (nn.Linear, FP8Linear)):  # FP8Linear.weight is dequantised per call
            m.forward = types.MethodType(_linear_forward, m)
        elif isinstance(m, RMSNorm):
            m.forward = types.MethodType(_rmsnorm_forward, m)
        elif isinstance(m, SwiGLU):
            m.forward = types.MethodType(_swiglu_forward, m)
            m._w13 = None  # routed experts: stacked per MoE (stack_experts_), never per expert
            if id(m) not in routed:
                stack_gate_up_(m)
        elif isinstance(m, MLAttention):
            absorb_weights_(m)
            if not getattr(m, "_absorb_hook", False):  # load_state_dict, in place or not: rebuild after it
                m.register_load_state_dict_post_hook(lambda module, _keys: absorb_weights_(module))
                m._absorb_hook = True
            m.absorb_q = types.MethodType(_absorb_q, m)
            m.project = types.MethodType(_project, m)
            m.expand_v = types.MethodType(_expand_v, m)
        elif isinstance(m, MoE):
            m.router_logits = types.MethodType(_router_logits, m)
            m.route = types.MethodType(_route, m)
            if stack_experts_(m):
                m.forward = types.MethodType(_moe_forward, m)
    for moe in [m for m in root.modules() if isinstance(m, MoE)]:  # (after the pass above set every Linear)
        for name, e in moe.experts.named_modules():
            if isinstance(e, (nn.Linear, FP8Linear)):
                down = name.endswith("down_proj")
                inter, hidden = (e.in_features, e.out_features) if down else (e.out_features, e.in_features)
                e._tiles = loop_tiles(down, inter, hidden)
                e.forward = types.MethodType(_expert_linear_forward, e)
    return root


def capturable(model: nn.Module) -> bool:
    """Whether ``model``'s forward has no host sync, so a CUDA graph can capture it: every MoE layer
    runs its routed experts grouped (``specdec_kernels.moe``; experts of mixed kinds fall back to the
    per-expert loop, which reads the group sizes on the host)."""
    return all(m.forward.__func__ is _moe_forward for m in model.modules()
               if isinstance(m, MoE) and hasattr(m.forward, "__func__"))


def row_invariant_(model: DeepseekModel) -> DeepseekModel:
    """Switch ``model`` (in place; after any tensor-parallel sharding) to the row-invariant
    kernels; returns it. Weights are shared with the torch path (kv_b is stored once more, as the absorbed
    W_UK^T and W_UV: its own size; the routed experts' and the stacked gate/up weights are re-homed, not copied)."""
    row_invariant_modules_(model)
    model.lm_head.forward = types.MethodType(_lm_head_forward, model.lm_head)
    model.attention = "triton"
    return model
