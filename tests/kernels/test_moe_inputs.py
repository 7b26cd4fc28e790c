"""specdec_kernels/moe.py and stack_experts_ on awkward inputs (found by a breaker in session 16): weights of another
layout, int32 ids, expert tensors replaced after stacking."""
import copy
import types

import pytest
import torch
from conftest import DTYPES

from specdec_kernels.moe import moe_experts, moe_experts_reference


def problem(T=6, E=5, k=2, H=64, inter=32, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(device, dtype)
    ids = torch.rand(T, E, generator=g).topk(k, -1).indices.to(device)
    return x, w13, w2, ids, (torch.rand(T, k, generator=g) * 2.5).to(device)


@pytest.mark.parametrize("which", ["w13", "w2"])
def test_non_contiguous_expert_weights_are_computed_right_or_refused(device, which):
    """The kernels assume stride 1 along each weight's last dim but never check it."""
    x, w13, w2, ids, w = problem(device=device, dtype=DTYPES[-1])
    want = moe_experts(x, w13, w2, ids, w)
    t = dict(w13=w13, w2=w2)
    t[which] = t[which].transpose(1, 2).contiguous().transpose(1, 2)  # same values, other layout
    try:
        got = moe_experts(x, t["w13"], t["w2"], ids, w)
    except ValueError:
        return
    torch.testing.assert_close(got, want)


def test_int32_ids_work_or_are_refused_with_value_error(device):
    x, w13, w2, ids, w = problem(device=device, dtype=DTYPES[-1])
    try:
        got = moe_experts(x, w13, w2, ids.int(), w)
    except ValueError:
        return
    assert torch.equal(got, moe_experts(x, w13, w2, ids, w))


def test_grouped_moe_does_not_read_stale_stacked_weights_after_load_state_dict_assign(device):
    """load_state_dict(assign=True) (or any ``p.data = ...``: tp.shard_, Module.to) replaces the
    experts' Parameters; the grouped path keeps reading the old ``_w13`` / ``_w2``."""
    from modeling.deepseek import DeepseekConfig, MoE
    from modeling.deepseek_fast import moe_loop, row_invariant_modules_

    cfg = DeepseekConfig.from_dict(dict(
        model_type="kimi_k2", vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=12, n_group=1, topk_group=1,
        num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256))

    def make(seed):
        torch.manual_seed(seed)
        m = MoE(cfg).to(device, DTYPES[-1])
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.1)
        return row_invariant_modules_(m)

    new = copy.deepcopy(make(1).state_dict())
    x = torch.randn(9, cfg.hidden_size).to(device, DTYPES[-1])
    m = make(0)
    m.load_state_dict(new, assign=True)
    with torch.inference_mode():
        assert torch.equal(m(x), moe_loop(m, x))  # grouped == per-expert loop over the same module
