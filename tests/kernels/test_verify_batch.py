"""TargetEngine.verify_batch (issue 14): several requests' trees in one call, each item's result
equal to the same request run alone (samples, edge probabilities, feature path and features bit
for bit), on the CPU path (fast="off", a loop of per-item forwards) and on the fast path (one
row-invariant Triton forward over all items' rows; the interpreter on CPU, the GPU with graphs
when there is one). Per-item errors leave the other items and all state unchanged; KV returns to
idle. Mixed requests: greedy and seeded sampled (temperature / top-k / top-p), autoregressive
one-row trees, chains and random trees, commits of different lengths (forced by trees that
contain the target's own continuation)."""
import random
import threading
import time

import pytest
import torch
from conftest import DEVICE

from modeling.acceptance import resolve
from modeling.config import LlamaConfig
from modeling.errors import FailedPrecondition, InvalidRequest, ResourceExhausted, UnknownRequest
from modeling.llama import LlamaModel, causal_mask
from modeling.sampling import SamplingParams, sample
from target_service.engine import TargetEngine, VerifyItem

CFG = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
POOL = 1024
# (request id, prompt length, sampling params, mode, tree budget, shape per round)
REQUESTS = [
    ("greedy-tree", 4, SamplingParams(), "tree", 8, ["tree", "tree"]),
    ("t0.9-k30-chain", 3, SamplingParams(0.9, 30, 1.0, 11), "chain", 8, ["chain", "chain"]),
    ("t1.3-p0.8-ar", 5, SamplingParams(1.3, 0, 0.8, 2**64 - 3), "autoregressive", 0, ["ar", "ar"]),
    ("t0.6-tree", 2, SamplingParams(0.6, 0, 1.0, 5), "tree", 8, ["tree", "ar"]),
]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    m = LlamaModel(CFG)
    with torch.no_grad():
        for p in m.parameters():  # peaked logits, so the forced paths are usually accepted
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 2 * p.shape[-1] ** -0.5) + (p.dim() == 1))
    return m.eval().requires_grad_(False)


_CONTINUATIONS = {}


def continuation(model, seq, params, count):
    """The target's own next ``count`` tokens after seq (greedy, or seeded by absolute position
    on the host sampler), eagerly on the CPU: a tree holding them gets a long accepted path."""
    key = (id(model), tuple(seq), params, count)
    if key not in _CONTINUATIONS:
        _CONTINUATIONS[key] = _continuation(model, seq, params, count)
    return _CONTINUATIONS[key]


def _continuation(model, seq, params, count):
    seq = list(seq)
    for _ in range(count):
        h, _ = model(torch.tensor(seq), torch.arange(len(seq)), model.new_cache(len(seq)), causal_mask(0, len(seq)))
        seq.append(int(sample(model.logits(h[-1:]), params, torch.tensor([len(seq)]))[0]))
    return seq[-count:]


def make_tree(shape, bonus, truth, g):
    """(tokens, parents): "ar" the root alone; "chain" the root then truth cut after a random
    number (at least half) of correct tokens; "tree" a random tree whose deepest root path
    carries such a truth prefix. Siblings get distinct tokens."""
    if shape == "ar":
        return [bonus], [-1]
    n = 1 + len(truth)
    if shape == "chain":
        parents = list(range(-1, n - 1))
    else:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    deepest = max(range(n), key=lambda v: (len(path_of(parents, v)), -v))
    keep = int(torch.randint(len(truth) // 2, len(truth) + 1, (1,), generator=g))
    tokens = [bonus] + [-1] * (n - 1)
    for j, v in enumerate(path_of(parents, deepest)[1:]):
        tokens[v] = truth[j] if j < keep else (truth[j] + 1) % CFG.vocab_size
    for v in range(1, n):
        taken = {tokens[u] for u in range(1, n) if u != v and parents[u] == parents[v]}
        while tokens[v] < 0 or tokens[v] in taken:
            tokens[v] = int(torch.randint(0, CFG.vocab_size, (1,), generator=g))
    return tokens, parents


def path_of(parents, v):
    out = [v]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def run(engine, model, batched, ids=None):
    """Prefill every request, then verify round by round, all items in one verify_batch
    (batched) or each alone; returns {request: [Verified per round]}."""
    g = torch.Generator().manual_seed(1)
    state, out = {}, {}
    for rid, plen, params, mode, budget, _ in REQUESTS:
        prompt = torch.randint(0, CFG.vocab_size, (plen,), generator=g).tolist()
        first = engine.prefill(rid, prompt, 40, params, mode, budget).first_token
        state[rid], out[rid] = [prompt, first, None], []
    for rnd in range(len(REQUESTS[0][5])):
        items = []
        for k, (rid, _, params, mode, budget, shapes) in enumerate(REQUESTS):
            ctx, bonus, commit = state[rid]
            truth = [] if shapes[rnd] == "ar" else continuation(model, ctx + [bonus], params,
                                                                4 if shapes[rnd] == "tree" else 3)
            tg = torch.Generator().manual_seed(100 * rnd + k)
            items.append(VerifyItem(rid, *make_tree(shapes[rnd], bonus, truth, tg), commit))
        results = engine.verify_batch(items) if batched else [engine.verify_batch([it])[0] for it in items]
        for it, v in zip(items, results):
            assert not isinstance(v, Exception), v
            out[it.request_id].append(v)
            path, bonus = resolve(it.tokens, it.parents, v.samples)
            state[it.request_id] = [state[it.request_id][0] + [it.tokens[i] for i in path], bonus, path]
    if DEVICE == "cpu":  # (the trees' truth comes from the fp32 CPU model; bf16 on the GPU may stray)
        assert max(len(s[2]) for s in state.values()) >= 3, "no long commit: the test would not move KV rows"
    engine.release([r[0] for r in REQUESTS])
    assert engine.live_requests == 0 and engine.reserved_tokens == 0
    if engine.pool is not None:
        assert engine.pool.free_pages == engine.pool.pages
    return out


def same(a, b):
    assert a.samples == b.samples and a.edge_probs == b.edge_probs and a.feature_nodes == b.feature_nodes
    assert (a.features is None) == (b.features is None)
    if a.features is not None:
        assert a.features.device.type == "cpu" and torch.equal(a.features, b.features)


FAST = ["off", "eager"] + (["graphs"] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("fast", FAST)
def test_verify_batch_equals_each_request_alone(fast):
    """4 mixed requests, two rounds (the second commits paths of different lengths, so one
    forward runs several requests' KV moves); max_batch 3 splits each round into a forward of
    three trees and a forward of one. Fast path: the batched engine's KV is paged in 16-row pages
    from a shuffled free list (each request on 4 non-contiguous pages; trees and commit moves
    cross page boundaries), the solo engine's in 128-row pages (one page per request): paging
    changes no bit."""
    model = tiny_model()
    fast_model = model if DEVICE == "cpu" else tiny_model().to(DEVICE, torch.bfloat16)  # bf16 on the GPU

    def make(page_rows):
        e = TargetEngine(fast_model if fast != "off" else model, (0,), 256, POOL, 8, fast=fast, max_batch=3,
                         kv_page_rows=page_rows)
        if e.pool is not None:
            random.Random(page_rows).shuffle(e.pool._free)
        return e

    batched, alone = run(make(16), model, True), run(make(128), model, False)
    for rid in batched:
        for a, b in zip(batched[rid], alone[rid]):
            same(a, b)


def test_verify_batch_item_errors_change_nothing():
    """A bad tree, an unknown id and a repeated id fail alone (their exception types as
    ``verify``); the good items' results equal a clean batch's, and the failed request's state
    is untouched (its next good verify equals a run where the bad item never came)."""
    model = tiny_model(2)
    outs = []
    for with_errors in (False, True):
        e = TargetEngine(model, (0,), 256, POOL, 8)
        b1 = e.prefill("a", [1, 2, 3], 20, SamplingParams(), "tree", 4).first_token
        b2 = e.prefill("b", [4, 5], 20, SamplingParams(0.8, 0, 1.0, 9), "tree", 4).first_token
        good = [VerifyItem("a", [b1, 7, 8], [-1, 0, 0]), VerifyItem("b", [b2, 9], [-1, 0])]
        bad = [VerifyItem("b", [b2, 5, 5], [-1, 0, 0]), VerifyItem("zzz", [1], [-1]), VerifyItem("a", [b1], [-1])]
        got = e.verify_batch([bad[0], good[0], bad[1], bad[2]]) if with_errors else [None, e.verify_batch(good[:1])[0]]
        if with_errors:
            assert isinstance(got[0], InvalidRequest) and "repeats a sibling" in str(got[0])
            assert isinstance(got[2], UnknownRequest) and isinstance(got[3], FailedPrecondition)
            assert "more than once" in str(got[3])
            assert e._requests["b"].pending is None and e._requests["b"].cache.length == 2
        rest = e.verify_batch(good[1:])[0]
        path = resolve(good[0].tokens, good[0].parents, got[1].samples)[0]
        nxt = e.verify_batch([VerifyItem("a", [got[1].samples[path[-1]]], [-1], path)])[0]
        outs.append((got[1], rest, nxt))
        e.release(["a", "b"])
        assert e.reserved_tokens == 0 and e.live_requests == 0
    for a, b in zip(*outs):
        same(a, b)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graphed_batches_equal_eager_full_then_small():
    """Graph replay of batched verifies equals the eager fast path bitwise in bf16: a batch
    of 9 requests × 5 rows in the largest bucket (49 rows), then a small batch of two trees of
    3 rows (bucket 9), then one (bucket 3): rows padded after a full batch would show stale data
    if any leaked. KV in 16-row pages from a shuffled free list (the same in both engines)."""
    model = tiny_model(3).to(DEVICE, torch.bfloat16)
    engines = [TargetEngine(model, (0,), 256, POOL, 4, fast=f, max_batch=16, max_forward_rows=49, kv_page_rows=16)
               for f in ("eager", "graphs")]
    for e in engines:
        random.Random(5).shuffle(e.pool._free)
    assert engines[1]._tree_forward.buckets[-1] == 49
    ids = [f"r{i}" for i in range(9)]
    outs = []
    for e in engines:
        g = torch.Generator().manual_seed(4)
        params = [SamplingParams() if i % 2 else SamplingParams(0.8, 5 * i, 0.9, i) for i in range(9)]
        bonus = {r: e.prefill(r, torch.randint(0, CFG.vocab_size, (3 + i,), generator=g).tolist(), 30, params[i],
                              "tree", 4).first_token for i, r in enumerate(ids)}
        commit, got = {r: None for r in ids}, []
        for rnd in [ids, ids[:2], ids[5:6]]:
            items = []
            for r in rnd:
                n = 5 if len(rnd) > 2 else 3
                toks = [bonus[r]] + torch.randperm(CFG.vocab_size, generator=g)[:n - 1].tolist()
                items.append(VerifyItem(r, toks, [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)],
                                        commit[r]))
            for it, v in zip(items, e.verify_batch(items)):
                assert not isinstance(v, Exception), v
                got.append(v)
                commit[it.request_id], bonus[it.request_id] = resolve(it.tokens, it.parents, v.samples)
        outs.append(got)
        e.release(ids)
        assert e.pool.free_pages == e.pool.pages
    for a, b in zip(*outs):
        same(a, b)


def test_paged_admission_waits_for_pages_and_returns_to_idle():
    """Admission counts free pages (4 pages of 16 rows): a request of 28 rows takes 2 pages at
    once; one that would fit the empty pool waits for pages (and gets them when a request is
    released), a waiting one released meanwhile ends with UnknownRequest, a full pool without
    a wait is ResourceExhausted naming the pages, and one that can never fit is refused at
    once; pages and reserved rows return to idle."""
    e = TargetEngine(tiny_model(4).to(DEVICE), (0,), 256, 64, 4, fast="eager", kv_page_rows=16)
    greedy = SamplingParams()
    a = e.prefill("a", [1, 2, 3], 20, greedy, "tree", 4)
    assert e.reserved_tokens == 32 and e.pool.free_pages == 2
    e.prefill("b", [4, 5, 6], 20, greedy, "tree", 4)
    with pytest.raises(ResourceExhausted, match="never fit.*kv_pool_tokens 64"):
        e.prefill("x", [1, 2, 3], 60, greedy, "tree", 4, wait_seconds=30)
    with pytest.raises(ResourceExhausted, match="KV pool full: request needs 28 rows = 2 pages of 16, 0 of 4"):
        e.prefill("c", [7, 8, 9], 20, greedy, "tree", 4)
    got = {}

    def open_(rid, prompt=(7, 8, 9), wait=30):
        got[rid] = _catch(lambda: e.prefill(rid, list(prompt), 20, greedy, "tree", 4, wait_seconds=wait))

    waiting = [threading.Thread(target=open_, args=(r,)) for r in ("c", "d")]
    for t in waiting:
        t.start()
    for _ in range(3000):  # both wait on the engine's condition
        if len(e._room._waiters) == 2:
            break
        time.sleep(0.01)
    e.release(["d"])  # d gives up while it waits (c still waits)
    waiting[1].join(30)
    assert isinstance(got["d"], UnknownRequest) and "while waiting" in str(got["d"])
    v = e.verify("a", [a.first_token, 5], [-1, 0])  # a still verifies while c waits
    assert len(v.samples) == 2 and "c" not in got
    e.release(["a"])  # c gets a's pages
    waiting[0].join(30)
    assert got["c"].first_token >= 0 and e.live_requests == 2 and e.pool.free_pages == 0
    assert e.release(["b", "c"]) == 2
    assert e.reserved_tokens == 0 and e.live_requests == 0 and e.pool.free_pages == e.pool.pages == 4
    # a prefill (7 chunks of max_tree_budget + 1 = 5 rows) released while it runs stops and returns its pages
    runner = threading.Thread(target=open_, args=("p", range(35), None))
    runner.start()
    while "p" not in e._prefilling and runner.is_alive():
        time.sleep(0.005)
    e.release(["p"])
    runner.join(60)
    assert isinstance(got["p"], UnknownRequest) and "during its prefill" in str(got["p"]), got["p"]
    assert e.reserved_tokens == 0 and e.live_requests == 0 and e.pool.free_pages == 4


def _catch(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 (the test inspects it)
        return err
