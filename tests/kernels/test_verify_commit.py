"""The GPU fast path's verify round trip: the commit's KV moves run inside the next forward
(``specdec_kernels.kv_commit``) and a greedy verify's samples, accepted-path end and path features come
back in one copy (``modeling.graphs.greedy_tail``). Checked against the eager torch engine on
trees whose accepted path is deep and not the leading rows (so rows really move, including a
destination that is a later source), round after round: same samples, same path, same features."""
import pytest
import torch
from conftest import DEVICE

from specdec_kernels.kv_commit import MAX_MOVES, kv_move, kv_move_reference
from modeling.acceptance import resolve
from modeling.config import LlamaConfig
from modeling.llama import LlamaModel, causal_mask
from modeling.sampling import SamplingParams
from target_service.engine import TargetEngine

CFG = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def test_kv_move_matches_reference():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 40, 2, 16, generator=g), torch.randn(3, 40, 2, 16, generator=g)
    path = [0, 2, 3, 5, 9]  # dst 2 (← 3) is a later source
    moves = torch.zeros(2 * MAX_MOVES, dtype=torch.int64)
    for i, r in enumerate(path):
        moves[i], moves[MAX_MOVES + i] = 20 + r, 20 + i
    want = k.clone(), v.clone()
    kv_move_reference(*want, moves)
    k, v, moves = k.to(DEVICE), v.to(DEVICE), moves.to(DEVICE)
    kv_move(k, v, moves)
    assert torch.equal(k.cpu(), want[0]) and torch.equal(v.cpu(), want[1])
    groups = torch.zeros(3, 2, MAX_MOVES, dtype=torch.int64)  # one group per request of a batch
    for grp, (top, path) in zip(groups, [(2, [0, 1, 4]), (0, []), (30, [0, 3, 5, 6])]):
        for i, r in enumerate(path):
            grp[0, i], grp[1, i] = top + r, top + i
    want = k.cpu().clone(), v.cpu().clone()
    kv_move_reference(*want, groups.flatten())
    kv_move(k, v, groups.flatten().to(DEVICE))
    assert torch.equal(k.cpu(), want[0]) and torch.equal(v.cpu(), want[1])


def test_paged_commit_equals_contiguous_commit():
    """A paged request (shuffled 4-row pages) commits a long path (the host gather,
    ``PagedCache.commit``) and a short one (``move_rows`` run by ``kv_move``) to exactly the
    K/V a contiguous ``KVCache`` holds after the same commits, position for position."""
    import random

    from modeling.kv_cache import KVCache, PagedKVPool

    g = torch.Generator().manual_seed(1)
    pool = PagedKVPool(2, 64, 2, 8, DEVICE, torch.float32, page_rows=4)
    random.Random(3).shuffle(pool._free)
    paged, flat = pool.allocate(40), KVCache(2, 40, 2, 8, "cpu", torch.float32)
    rows = paged.rows(range(40))
    assert sorted(set(rows // 4)) == sorted(paged.pages) and len(paged.pages) == 10
    k, v = torch.randn(2, 40, 2, 8, generator=g), torch.randn(2, 40, 2, 8, generator=g)
    flat.k[:], flat.v[:] = k, v
    pool.k[:, rows], pool.v[:, rows] = k.to(DEVICE), v.to(DEVICE)
    flat.length = paged.length = 3
    long_path = [0, 1, 3, 4, 6, 9, 10, 11, 12, 14, 15, 17, 20, 21, 22, 23, 25, 27]  # > MAX_MOVES: host gather
    for c in (flat, paged):
        c.commit(torch.tensor(long_path))
    short = [0, 2, 5]
    moves = torch.zeros(2 * MAX_MOVES, dtype=torch.int64)
    for i, (src, dst) in enumerate(paged.move_rows(short)):
        moves[i], moves[MAX_MOVES + i] = src, dst
    kv_move(pool.k, pool.v, moves.to(DEVICE))
    paged.length += len(short)
    flat.commit(torch.tensor(short))
    assert flat.length == paged.length == 3 + len(long_path) + len(short)
    got = paged.rows(range(flat.length))
    assert torch.equal(pool.k[:, got].cpu(), flat.k[:, :flat.length])
    assert torch.equal(pool.v[:, got].cpu(), flat.v[:, :flat.length])
    pool.free(paged)
    assert pool.free_pages == pool.pages == 16


def greedy_next(model, seq, count):
    """The model's greedy continuation of seq (count tokens), eagerly on the CPU."""
    seq = list(seq)
    for _ in range(count):
        x = torch.tensor(seq)
        h, _ = model(x, torch.arange(len(seq)), model.new_cache(len(seq)), causal_mask(0, len(seq)))
        seq.append(int(model.logits(h[-1:]).argmax()))
    return seq[-count:]


def forced_tree(bonus, want):
    """A 7-node tree whose greedy-accepted path is [0, 2, 4, 6] (tokens want[0..2]) with
    decoys beside it; returns (tokens, parents)."""
    other = lambda t: (t + 1) % CFG.vocab_size
    parents = [-1, 0, 0, 2, 2, 1, 4]
    tokens = [bonus, other(want[0]), want[0], other(want[1]), want[1], want[0], want[2]]
    return tokens, parents


GRAPHS = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("mode,temperature", [("eager", 0.0), ("eager", 0.05), pytest.param("graphs", 0.0, marks=GRAPHS),
                                              pytest.param("graphs", 0.05, marks=GRAPHS)])
def test_fast_verify_round_trip_matches_eager_engine(mode, temperature):
    """Greedy, and sampled at a low temperature (seeded: the same draws on both engines; the
    forced path is then almost surely accepted too)."""
    torch.manual_seed(5)
    model = LlamaModel(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5) + (p.dim() == 1))
    model = model.eval().requires_grad_(False)
    fast_model = LlamaModel(CFG)
    fast_model.load_state_dict(model.state_dict())
    fast_model = fast_model.to(DEVICE).eval().requires_grad_(False)
    off = TargetEngine(model, (0,), 256, 1024, 8, fast="off")
    fast = TargetEngine(fast_model, (0,), 256, 1024, 8, fast=mode)
    prompt = torch.randint(0, CFG.vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature, 0, 1.0, 7)
    bonus = [e.prefill("r", prompt, 40, params, "tree", 8).first_token for e in (off, fast)]
    assert bonus[0] == bonus[1]
    ctx, bonus, commit = list(prompt), bonus[0], None
    for _ in range(2):  # the second verify commits the first tree's path on the device
        tokens, parents = forced_tree(bonus, greedy_next(model, ctx + [bonus], 3))
        a = off.verify("r", tokens, parents, commit)
        b = fast.verify("r", tokens, parents, commit)
        assert a.samples == b.samples and a.feature_nodes == b.feature_nodes
        torch.testing.assert_close(b.edge_probs, a.edge_probs, rtol=1e-4, atol=1e-6)
        commit, bonus = resolve(tokens, parents, a.samples)
        assert commit == [0, 2, 4, 6] or temperature
        fa, fb = a.features, b.features
        assert fb.device.type == "cpu" and fb.shape == fa.shape == (4, CFG.hidden_size)
        torch.testing.assert_close(fb, fa, rtol=1e-4, atol=1e-4)
        ctx += [tokens[i] for i in commit]
    for e in (off, fast):
        e.release(["r"])
    assert fast.pool.free_pages == fast.pool.pages
