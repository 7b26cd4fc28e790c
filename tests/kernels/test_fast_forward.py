"""The row-invariant forward (Triton kernels over the KV pool) equals the eager model, and a
tree node's logits are bitwise those of a one-row decode at its position after its ancestors
were committed, for random trees; graph replay equals eager at every bucket (GPU only)."""
import pytest
import torch
from conftest import DEVICE, DTYPES

from modeling.config import LlamaConfig
from modeling.fast_forward import RowInvariantLlama
from modeling.graphs import EagerVerify
from modeling.kv_cache import KVPool
from modeling.llama import LlamaModel, causal_mask, tree_mask
from modeling.tree import tree_ancestors, visibility

CFG = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
TAPS = (0, 2)


def tiny_model(dtype, seed=0):
    torch.manual_seed(seed)
    m = LlamaModel(CFG)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5) + (p.dim() == 1))
    return m.to(DEVICE, dtype).eval().requires_grad_(False)


def random_tree(n, g):
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def setup(dtype, prefix_len, seed):
    model = tiny_model(dtype, seed)
    pool = KVPool(CFG.num_hidden_layers, 1024, CFG.num_key_value_heads, CFG.head_dim, DEVICE, dtype)
    pool.allocate(37)  # so the request's range does not start at row 1
    cache = pool.allocate(400)
    prompt = torch.randint(0, CFG.vocab_size, (prefix_len,), device=DEVICE)
    with torch.inference_mode():
        model(prompt, torch.arange(prefix_len, device=DEVICE), cache, causal_mask(0, prefix_len, DEVICE))
    cache.length = prefix_len
    return model, pool, cache


def run_tree(verify, cache, tokens, parents):
    """verify: an ``EagerVerify`` or ``VerifyGraphs``; returns (logits, features)."""
    depths, anc = tree_ancestors(parents)
    return verify(tokens, depths, anc, cache.base, cache.length)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_forward_matches_eager_model(dtype):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    model, pool, cache = setup(dtype, 45, 1)
    fwd = EagerVerify(RowInvariantLlama(model, pool, TAPS), 64, torch.device(DEVICE))
    parents = random_tree(20, g)
    tokens = torch.randint(0, CFG.vocab_size, (20,), generator=g).tolist()
    logits, feats = run_tree(fwd, cache, tokens, parents)
    depths, anc = tree_ancestors(parents)
    vis = torch.from_numpy(visibility(depths, anc)).to(DEVICE)
    with torch.inference_mode():
        hidden, want_feats = model(torch.tensor(tokens, device=DEVICE), 45 + torch.from_numpy(depths).to(DEVICE),
                                   cache, tree_mask(45, vis), TAPS)
        want = model.logits(hidden)
    tol = 1e-3 if dtype == torch.float32 else 0.15
    assert (logits - want).abs().max() <= tol * want.abs().max()
    assert feats.shape == want_feats.shape and (feats - want_feats).abs().max() <= tol * want_feats.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_node_logits_equal_one_row_decode(dtype):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    model, pool, cache = setup(dtype, 70, 2)
    fwd = EagerVerify(RowInvariantLlama(model, pool, TAPS), 64, torch.device(DEVICE))
    n = 40 if DEVICE == "cuda" else 6  # the interpreter runs ~1 forward/s
    parents = random_tree(n, g)
    tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
    k0, v0 = pool.k.clone(), pool.v.clone()
    tree_logits, _ = run_tree(fwd, cache, tokens, parents)
    tree_logits = tree_logits.clone()
    depths, anc = tree_ancestors(parents)
    L = cache.length
    for i in range(n):
        pool.k.copy_(k0), pool.v.copy_(v0)
        cache.length = L
        path = anc[i, :depths[i]].tolist()  # ancestors of i, root first: decode them one by one
        for j in path:
            run_tree(fwd, cache, [tokens[j]], [-1])
            cache.commit(torch.tensor([0]))
        one, _ = run_tree(fwd, cache, [tokens[i]], [-1])
        assert torch.equal(one[0], tree_logits[i]), f"node {i} at depth {depths[i]}"
    cache.length = L


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager_at_every_bucket():
    from modeling.graphs import VerifyGraphs

    g = torch.Generator().manual_seed(0)
    model, pool, cache = setup(torch.bfloat16, 60, 3)
    fwd = RowInvariantLlama(model, pool, TAPS)
    eager = EagerVerify(fwd, 100, torch.device("cuda"))
    graphs = VerifyGraphs(fwd, 100, torch.device("cuda"))
    graphs.capture()
    k0, v0 = pool.k.clone(), pool.v.clone()
    sizes = [100] + [n for b in graphs.buckets for n in {b, max(1, b - 5)} if n <= 100] + [100, 1]
    for n in sizes:  # every bucket, full and padded, after larger trees, so stale rows would show
        parents = random_tree(n, g)
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
        pool.k.copy_(k0), pool.v.copy_(v0)
        want, wf = run_tree(eager, cache, tokens, parents)
        want, wf = want.clone(), wf.clone()
        pool.k.copy_(k0), pool.v.copy_(v0)
        got, gf = run_tree(graphs, cache, tokens, parents)
        assert torch.equal(got, want) and torch.equal(gf, wf), n


@pytest.mark.cpu_slow  # CI time: ~10 s in the interpreter; runs in every GPU run
def test_tree_sampling_on_the_device_draws_the_host_law():
    """EagerVerify.sample (and, on the GPU, every bucket's sampling graph, right after larger
    trees) draws each node from the processed law of the host path (same tokens for fixed seeds;
    edge probabilities within 1e-12), with temperature, top-k and top-p."""
    from modeling.sampling import SamplingParams, filtered, processed_logprobs, sample, sampling_words

    g = torch.Generator().manual_seed(7)
    model, pool, cache = setup(torch.float32, 40, 5)
    fwd = RowInvariantLlama(model, pool, TAPS)
    verifiers = [EagerVerify(fwd, 40, torch.device(DEVICE))]
    if DEVICE == "cuda":
        from modeling.graphs import VerifyGraphs
        verifiers.append(VerifyGraphs(fwd, 40, torch.device("cuda")))
        verifiers[-1].capture()
    cases = [SamplingParams(0.7, 0, 1.0, 11), SamplingParams(1.3, 20, 1.0, 2**64 - 5),
             SamplingParams(0.9, 0, 0.8, 3), SamplingParams(1.0, 50, 0.6, 12345)]
    for n, params in zip((40, 9, 1, 17), cases):
        parents = random_tree(n, g)
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
        depths, anc = tree_ancestors(parents)
        for verify in verifiers:
            logits, _ = verify(tokens, depths, anc, cache.base, cache.length, sampling_words(params))
            got = verify.sample(filtered(params)).cpu()
            if not filtered(params):  # the unfiltered graph is bitwise the general one
                assert torch.equal(got, verify.sample(True).cpu())
            lp = processed_logprobs(logits.cpu(), params)
            pos = cache.length + torch.from_numpy(depths)
            assert got[0].long().tolist() == sample(logits.cpu(), params, pos + 1, lp).tolist()
            par = torch.tensor(parents).clamp(min=0)
            edge = lp[par].gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).exp()
            assert torch.allclose(got[1, 1:], edge[1:], rtol=0, atol=1e-12)


@pytest.mark.cpu_slow  # CI time: ~15 s in the interpreter; runs in every GPU run
def test_target_engine_fast_path_matches_eager_engine():
    """TargetEngine(fast="eager") (KV pool + row-invariant forward; its prefill in chunks as
    chains through that forward) samples the same tokens as the eager torch engine round after
    round (greedy), commits, and frees its pool rows."""
    from modeling.acceptance import resolve
    from modeling.sampling import SamplingParams
    from target_service.engine import TargetEngine

    model = tiny_model(torch.float32, 5)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    engines = [TargetEngine(model, TAPS, 512, 2048, 16, fast=f) for f in ("off", "eager")]
    prompt = torch.randint(0, CFG.vocab_size, (30,), generator=g).tolist()
    # distinct tokens, so siblings never repeat one (a tree the engine would refuse)
    trees = [(random_tree(n, g), torch.randperm(CFG.vocab_size, generator=g)[:n].tolist()) for n in (5, 17, 1, 9)]
    outs = []
    for e in engines:
        bonus = e.prefill("r", prompt, 40, SamplingParams(), "tree", 16).first_token
        got, commit = [], None
        for parents, tokens in trees:
            v = e.verify("r", [bonus] + tokens[1:], parents, commit)
            got.append(v.samples)
            commit, bonus = resolve([bonus] + tokens[1:], parents, v.samples)  # the orchestrator's walk
        outs.append(got)
        e.release(["r"])
    assert outs[0] == outs[1]
    assert engines[1].pool.free_pages == engines[1].pool.pages
