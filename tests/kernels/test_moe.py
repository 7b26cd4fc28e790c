"""Grouped MoE experts (kernels/moe.py): equal to the float64 reference on fresh random inputs,
a token's bits independent of the tokens beside it, and — through ``row_invariant_`` — the
same bits as the per-expert loop of ``kernels.matmul.linear`` + ``kernels.swiglu`` it replaces."""
import types

import pytest
import torch
from conftest import DTYPES
from test_kernel_ops import close

from kernels.moe import expert_tiles, moe_experts, moe_experts_reference


def problem(T, E, k, H, inter, dtype, device, g):
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(device, dtype)
    ids = torch.rand(T, E, generator=g).topk(k, -1).indices.to(device)   # k distinct experts per token
    w = torch.rand(T, k, generator=g).to(device) * 2.5
    return x, w13, w2, ids, w


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_match_reference_and_are_row_invariant(device, dtype):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for T, E, k, H, inter in [(1, 8, 2, 64, 32), (21, 6, 3, 80, 48), (40, 4, 2, 64, 32)]:  # (40: tiles of 16+)
        x, w13, w2, ids, w = problem(T, E, k, H, inter, dtype, device, g)
        out = moe_experts(x, w13, w2, ids, w)
        assert out.dtype == dtype and out.shape == (T, H)
        close(out, moe_experts_reference(x, w13, w2, ids, w), dtype)
        for i in {0, T // 2, T - 1}:  # a token alone, and among other tokens in another order
            assert torch.equal(moe_experts(x[i:i + 1], w13, w2, ids[i:i + 1], w[i:i + 1])[0], out[i])
            perm = torch.randperm(T, generator=g).to(device)
            again = moe_experts(x[perm], w13, w2, ids[perm], w[perm])
            assert torch.equal(again[(perm == i).nonzero()[0, 0]], out[i])
        assert torch.equal(moe_experts(x, w13, w2, ids, w, block_m=32), out)  # the tile height: same bits


def test_expert_tiles_cover_each_pair_once_with_one_expert_per_tile(device):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for T, E, k, bm in [(1, 8, 8, 16), (50, 5, 3, 16), (7, 40, 6, 4)]:
        ids = torch.rand(T, E, generator=g).topk(k, -1).indices.to(device)
        tok, tiles, pos, slot = expert_tiles(ids, E, bm)
        flat = ids.flatten().cpu()
        seen = torch.zeros(T * k, dtype=torch.int64)
        for e, start, cnt in tiles.cpu().tolist():
            assert 0 <= cnt <= bm
            pairs = torch.arange(start, start + cnt)
            seen[pairs] += 1
        assert torch.equal(seen, torch.ones(T * k, dtype=torch.int64))  # every sorted pair in one tile
        order = flat.argsort(stable=True)
        assert torch.equal(tok.cpu().long(), order // k)
        for e, start, cnt in tiles.cpu().tolist():
            assert (flat[order[start:start + cnt]] == e).all()      # one expert per tile
        # pos: each token's pairs in ascending expert id
        assert torch.equal(order[pos.cpu()] // k, torch.arange(T)[:, None].expand(T, k))
        assert (flat[order[pos.cpu()]].diff(dim=1) > 0).all()
        assert torch.equal(ids.gather(1, slot), ids.sort(1).values)


def test_moe_experts_refuse_mismatched_shapes(device):
    g = torch.Generator().manual_seed(0)
    x, w13, w2, ids, w = problem(3, 4, 2, 64, 32, torch.float32, device, g)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_experts(x[:, :32], w13, w2, ids, w)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_experts(x, w13, w2[:, :, :16], ids, w)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_experts(x, w13, w2, ids, w[:, :1])


def test_grouped_experts_equal_the_per_expert_loop_bit_for_bit(device):
    """``row_invariant_``'s MoE (stacked weights, kernels/moe.py) against the same module with its
    per-expert loop of row-invariant linears; the stacked weights are views (no copy kept)."""
    from modeling.deepseek import DeepseekConfig, MoE
    from modeling.deepseek_fast import _moe_forward, _linear_forward, _swiglu_forward, stack_experts_
    from modeling.layers import SwiGLU

    dtype = DTYPES[0]
    cfg = DeepseekConfig.from_dict(dict(
        model_type="kimi_k2", vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=12, n_group=1, topk_group=1,
        num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256))
    torch.manual_seed(torch.seed() % 2**31)
    moe = MoE(cfg).to(device, dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    for mod in moe.modules():  # the row-invariant per-expert path: linear + swiglu kernels
        if isinstance(mod, torch.nn.Linear):
            mod.forward = types.MethodType(_linear_forward, mod)
        elif isinstance(mod, SwiGLU):
            mod.forward = types.MethodType(_swiglu_forward, mod)
    x = torch.randn(19, cfg.hidden_size).to(device, dtype)
    with torch.inference_mode():
        loop = moe(x)
        gate0 = moe.experts[3].gate_proj.weight.clone()
        assert stack_experts_(moe)
        assert moe.experts[3].gate_proj.weight.data_ptr() == moe._w13[3].data_ptr()  # a view, not a copy
        assert torch.equal(moe.experts[3].gate_proj.weight, gate0)
        grouped = _moe_forward(moe, x)
        assert torch.equal(grouped, loop)
        assert torch.equal(moe(x), loop)  # the loop over the re-homed weights: unchanged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_moe_experts_have_no_host_sync_and_replay_in_a_cuda_graph():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, w13, w2, ids, w = problem(9, 12, 4, 64, 32, torch.bfloat16, "cuda", g)
    want = moe_experts(x, w13, w2, ids, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync (bincount, .item(), .tolist()) raises during capture
        out = moe_experts(x, w13, w2, ids, w)
    x2, _, _, ids2, w_2 = problem(9, 12, 4, 64, 32, torch.bfloat16, "cuda", g)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w_2)  # new tokens and routing, the same buffers
    graph.replay()
    assert torch.equal(out, moe_experts(x, w13, w2, ids, w)) and not torch.equal(out, want)
