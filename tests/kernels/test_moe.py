"""Grouped MoE experts (specdec_kernels/moe.py): equal to the float64 reference on fresh random inputs,
a token's bits independent of the tokens beside it, and — through ``row_invariant_`` — the
same bits as the per-expert loop of ``specdec_kernels.matmul.linear`` + ``specdec_kernels.swiglu`` it replaces."""

import pytest
import torch
from conftest import DTYPES
from test_kernel_ops import close

from specdec_kernels.moe import (expert_tiles, expert_tiles_one_launch, expert_tiles_reference, moe_experts,
                         moe_experts_reference)


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
        split = moe_experts(x, w13, w2, ids, w, tiles=SPLIT_TILES)  # split-K: partials summed in order
        close(split, moe_experts_reference(x, w13, w2, ids, w), dtype)
        assert torch.equal(moe_experts(x[T - 1:], w13, w2, ids[T - 1:], w[T - 1:], tiles=SPLIT_TILES)[0], split[-1])


# gate/up split in 3 runs of 16-wide K blocks, down in 2 (Tiles: BM, BN, BK, warps, stages, split-K count)
SPLIT_TILES = ((16, 32, 16, 4, 2, 3), (16, 32, 16, 4, 2, 2))


@pytest.mark.parametrize("T, E, k, bm", [(1, 8, 8, 16), (50, 5, 3, 16), (7, 40, 6, 4), (64, 384, 8, 16),
                                          (513, 384, 8, 16), (3, 2, 2, 16)])
def test_expert_tiles_cover_each_pair_once_with_one_expert_per_tile(device, T, E, k, bm):
    """The one-launch sort (≤ SMALL_PAIRS pairs: 512 tokens × top-8) and the torch ops beyond it
    (513 × 8)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    ids = torch.rand(T, E, generator=g).topk(k, -1).indices.to(device)
    w = torch.rand(T, k, generator=g).to(device)
    tok, tiles, pos, slot, wt = expert_tiles(ids, E, bm, w)
    ref = expert_tiles_reference(ids, E, bm)
    used = ref[1][:, 2] > 0
    assert torch.equal(tiles[:, 2] > 0, used) and torch.equal(tiles[used], ref[1][used])
    for got, want in zip((tok, pos, slot), ref[:1] + ref[2:]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(wt, w.gather(1, slot))
    assert expert_tiles(ids, E, bm)[4] is None
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


@pytest.mark.parametrize("T, E, k, warps", [(256, 384, 8, 8), (300, 7, 5, 16)])
def test_one_launch_sort_equals_the_torch_ops_at_any_warps(device, T, E, k, warps):
    """The one-launch kernel at 2048 and 1500 pairs with other warp counts than ``expert_tiles``
    picks (the bench's --sort times 4, 8 and 16; 1500: P not a power of two, runs longer than a tile)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    ids = torch.rand(T, E, generator=g).topk(k, -1).indices.to(device)
    w = torch.rand(T, k, generator=g).to(device)
    tok, tiles, pos, slot, wt = expert_tiles_one_launch(ids, E, 16, w, num_warps=warps)
    ref = expert_tiles_reference(ids, E, 16)
    used = ref[1][:, 2] > 0
    assert torch.equal(tiles[:, 2] > 0, used) and torch.equal(tiles[used], ref[1][used])
    for got, want in zip((tok, pos, slot), ref[:1] + ref[2:]):
        assert torch.equal(got, want)
    assert torch.equal(wt, w.gather(1, slot))


def test_moe_experts_refuse_mismatched_shapes(device):
    g = torch.Generator().manual_seed(0)
    x, w13, w2, ids, w = problem(3, 4, 2, 64, 32, torch.float32, device, g)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_experts(x[:, :32], w13, w2, ids, w)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_experts(x, w13, w2[:, :, :16], ids, w)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_experts(x, w13, w2, ids, w[:, :1])
    with pytest.raises(ValueError, match="moe_experts"):  # an odd 2I
        moe_experts(x, w13[:, :63], w2, ids, w)
    with pytest.raises(ValueError, match="moe_experts"):  # 1-D ids
        moe_experts(x, w13, w2, ids[:, 0], w[:, 0])
    with pytest.raises(ValueError, match="block_m"):
        moe_experts(x, w13, w2, ids, w, block_m=24)
    with pytest.raises(ValueError, match="stride"):
        moe_experts(x, w13, w2.transpose(1, 2).contiguous().transpose(1, 2), ids, w)
    with pytest.raises(ValueError, match="split-K count"):
        moe_experts(x, w13, w2, ids, w, tiles=(SPLIT_TILES[0], (16, 32, 16, 4, 2, 0)))


@pytest.mark.parametrize("block", [(16, 32), (16, 128)], ids=["scale-per-element", "scale-per-row"])
def test_moe_experts_with_fp8_weights_match_reference_and_are_row_invariant(device, block):
    """Weights kept in FP8 with block scales (several blocks per weight), dequantised tile by tile
    inside the kernels: blocks narrower than a K step take a scale per element, others one per row."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    dtype = DTYPES[0]
    T, E, k, H, inter = 13, 6, 3, 96, 48
    x, w13, w2, ids, w = problem(T, E, k, H, inter, torch.float32, "cpu", g)

    def q(m):  # per block: amax / 448 scales (modeling.deepseek_weights.quantize_fp8's rule, non-square)
        out, sc = [], []
        for r0 in range(0, m.shape[0], block[0]):
            row_q, row_s = [], []
            for c0 in range(0, m.shape[1], block[1]):
                b = m[r0:r0 + block[0], c0:c0 + block[1]]
                s = b.abs().amax().clamp(min=1e-12) / 448
                row_q.append((b / s).to(torch.float8_e4m3fn))
                row_s.append(s)
            out.append(torch.cat(row_q, 1))
            sc.append(torch.stack(row_s))
        return torch.cat(out), torch.stack(sc)

    q13 = [torch.cat([q(m[:inter])[0], q(m[inter:])[0]]) for m in w13]
    s13 = [torch.cat([q(m[:inter])[1], q(m[inter:])[1]]) for m in w13]
    q2, s2 = zip(*(q(m) for m in w2))
    w13q, w2q = torch.stack(q13).to(device), torch.stack(q2).to(device)
    scales = (torch.stack(s13).to(device), torch.stack(s2).to(device))
    x, ids, w = x.to(device, dtype), ids.to(device), w.to(device)
    out = moe_experts(x, w13q, w2q, ids, w, scales=scales, block=block)
    close(out, moe_experts_reference(x, w13q, w2q, ids, w, scales, block), dtype)
    for i in (0, T - 1):
        assert torch.equal(moe_experts(x[i:i + 1], w13q, w2q, ids[i:i + 1], w[i:i + 1], scales=scales,
                                       block=block)[0], out[i])
    assert torch.equal(moe_experts(x, w13q.view(torch.uint8), w2q.view(torch.uint8), ids, w, scales=scales,
                                   block=block), out)
    split = moe_experts(x, w13q, w2q, ids, w, scales=scales, block=block, tiles=SPLIT_TILES)  # runs across blocks
    close(split, moe_experts_reference(x, w13q, w2q, ids, w, scales, block), dtype)
    with pytest.raises(ValueError, match="expected"):  # a scale grid of other blocks
        moe_experts(x, w13q, w2q, ids, w, scales=scales, block=(8, 8))


def moe_module(device, dtype, keep_fp8: bool):
    """A tiny Kimi-style MoE (plain modules), its expert weights in bf16/fp32 or kept in FP8
    (``FP8Linear``, 16 × 16 blocks)."""
    from modeling.deepseek import DeepseekConfig, MoE
    from modeling.deepseek_weights import FP8Linear, quantize_fp8

    cfg = DeepseekConfig.from_dict(dict(
        model_type="kimi_k2", vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=12, n_group=1, topk_group=1,
        num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256))
    torch.manual_seed(torch.seed() % 2**31)
    moe = MoE(cfg).to(device, dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if keep_fp8:
        for ex in moe.experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                qw, sc = quantize_fp8(getattr(ex, name).weight.data.float().cpu(), 16)
                setattr(ex, name, FP8Linear(qw.to(device), sc.to(device), (16, 16), dtype))
    return cfg, moe


# the experts' weight shapes (N, K) at moe_module's sizes given linear tilings with split-K and other K blocks
OTHER_TILINGS = {(32, 64): (16, 32, 32, 4, 2, 3), (64, 32): (64, 64, 16, 4, 3, 2)}


@pytest.mark.parametrize("moe_split", [{}, {(32, 64): (3, 2)}], ids=["moe-unsplit", "moe-split-k"])
@pytest.mark.parametrize("table", [{}, OTHER_TILINGS], ids=["table", "split-k-and-other-bk"])
@pytest.mark.parametrize("keep_fp8", [False, True], ids=["bf16-or-fp32", "fp8-kept"])
def test_grouped_experts_equal_the_per_expert_loop_bit_for_bit(device, keep_fp8, table, moe_split, monkeypatch):
    """``row_invariant_modules_``'s MoE (stacked weights, specdec_kernels/moe.py) against the same module's
    per-expert loop of row-invariant linears, whatever tiling the linear table gives the experts'
    shapes and whether specdec_kernels.moe splits K (the loop folds K as specdec_kernels.moe does:
    ``specdec_kernels.moe.loop_tiles``); the stacked weights are views."""
    import specdec_kernels.matmul as mm
    import specdec_kernels.moe as km
    from modeling.deepseek import MoE
    from modeling.deepseek_fast import moe_loop, row_invariant_modules_

    monkeypatch.setattr(mm, "TILE_TABLE", {**mm.TILE_TABLE, **table})
    monkeypatch.setattr(km, "MOE_SPLIT", moe_split)
    if moe_split:  # K blocks of 16 (the experts' K is 64 and 32): 3 and 2 runs of whole blocks
        monkeypatch.setattr(km, "MOE_TILES", ((32, 16, 4, 2), (32, 16, 4, 2)))
    dtype = DTYPES[0]
    cfg, moe = moe_module(device, dtype, keep_fp8)
    x = torch.randn(19, cfg.hidden_size).to(device, dtype)
    with torch.inference_mode():
        gate0 = moe.experts[3].gate_proj.weight.clone()
        row_invariant_modules_(moe)
        stored = moe.experts[3].gate_proj.w_u8 if keep_fp8 else moe.experts[3].gate_proj.weight
        assert stored.data_ptr() == moe._w13[3].data_ptr()  # a view, not a copy
        assert torch.equal(moe.experts[3].gate_proj.weight, gate0)
        assert (moe._moe_scales is not None) == keep_fp8
        loop = moe_loop(moe, x)  # the per-expert loop over the re-homed weights
        assert torch.equal(moe(x), loop)


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


def test_expert_tiles_refuse_bad_arguments_and_stay_in_bounds_outside_the_contract(device):
    """Arguments a host can check give ValueError naming them; ids outside the contract (repeated in a
    token, at or above n_experts) give wrong tiles but every pos / slot place written, no tile past the
    table (the breaker's heap corruption, session 19)."""
    ids = torch.tensor([[0, 5], [7, 2], [3, 1]]).to(device)
    for args, name in [((ids, 0), "n_experts"), ((ids, 8, 0), "block_m"), ((ids, 8, 16.0), "block_m"),
                       ((ids.float(), 8), "ids"), ((ids[0], 8), "ids"),
                       ((ids, 8, 16, torch.ones(3, 1).to(device)), "weights")]:
        with pytest.raises(ValueError, match=name):
            expert_tiles(*args)
    with pytest.raises(ValueError, match="int32 keys"):
        expert_tiles_one_launch(ids, 2**28)
    tok, tiles, pos, slot, _ = expert_tiles(ids, 4)  # ids 5 and 7 past a table sized for 4 experts
    assert tiles.shape[0] == 5 and torch.equal(pos.flatten().cpu().sort().values, torch.arange(6))
    used = tiles[:, 2].cpu() > 0
    assert (tiles[used, 0].cpu() < 4).all() and tiles[used, 2].sum().item() == 4  # the 4 in-range pairs
    tok, tiles, pos, slot, _ = expert_tiles(torch.tensor([[3, 3], [1, 2]]).to(device), 4)
    assert torch.equal(slot.cpu().sort(1).values, torch.tensor([[0, 1], [0, 1]]))
    assert torch.equal(pos.flatten().cpu().sort().values, torch.arange(4))
