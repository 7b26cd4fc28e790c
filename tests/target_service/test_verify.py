"""Tree verification against plain forwards, and commit against a fresh prefill (real weights)."""
import torch

from draft_service.ddtree import build_ddtree
from modeling.llama import causal_mask, tree_mask
from modeling.sampling import SamplingParams
from target_service.engine import TargetEngine, tree_structure

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198]


def plain_logits(model, tokens):
    cache = model.new_cache(len(tokens))
    h, _ = model(torch.tensor(tokens), torch.arange(len(tokens)), cache, causal_mask(0, len(tokens)))
    return model.logits(h)


def random_tree(budget, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 6, vocab, generator=g) * 4
    return build_ddtree(logits, torch.tensor([PROMPT[-1]]), budget)[0]


def test_tree_logits_equal_path_forwards(target_model):
    m = target_model
    prefix, root = PROMPT[:-1], PROMPT[-1]
    tree = random_tree(24, seed=int(torch.randint(0, 10**6, ())), vocab=300)
    cache = m.new_cache(len(prefix) + tree.tokens.numel())
    m(torch.tensor(prefix), torch.arange(len(prefix)), cache, causal_mask(0, len(prefix)))
    cache.length = len(prefix)
    depths, vis = tree_structure(tree.parents)
    assert torch.equal(depths, tree.depths) and torch.equal(vis, tree.visibility)
    h, _ = m(tree.tokens, len(prefix) + depths, cache, tree_mask(len(prefix), vis))
    tree_logits = m.logits(h)
    for v in range(tree.tokens.numel()):
        path = vis[v].nonzero().squeeze(-1)
        ref = plain_logits(m, prefix + tree.tokens[path].tolist())[-1]
        torch.testing.assert_close(tree_logits[v], ref, atol=2e-4, rtol=1e-4)


def walk(tokens, parents, v):
    from modeling import acceptance
    return acceptance.resolve(tokens, parents, v.samples)


def test_commit_equals_fresh_prefill(target_model):
    m = target_model
    greedy = SamplingParams()
    engine = TargetEngine(m, (1, 14, 27), max_context=512, kv_pool_tokens=4096, max_tree_budget=64)
    first = engine.prefill("r", PROMPT, 32, greedy, "tree", 8).first_token
    # A tree whose greedy path is partly present: the true next 3 tokens on one branch.
    seq = PROMPT + [first]
    for _ in range(3):
        seq.append(int(plain_logits(m, seq)[-1].argmax()))
    truth = seq[len(PROMPT) + 1:]
    tokens = [first, 5, truth[0], 7, truth[1], 9, truth[2]]
    parents = [-1, 0, 0, 2, 2, 4, 4]
    out = engine.verify("r", tokens, parents)
    path, bonus = walk(tokens, parents, out)
    assert path == [0, 2, 4, 6] and out.feature_nodes == path
    committed = PROMPT + [first] + truth
    assert bonus == int(plain_logits(m, committed)[-1].argmax())
    # Features of the committed tokens equal those of a fresh prefill of the committed sequence.
    fresh = TargetEngine(m, (1, 14, 27), max_context=512, kv_pool_tokens=4096, max_tree_budget=64)
    ref = fresh.prefill("f", committed, 32, greedy, "tree", 8)
    torch.testing.assert_close(out.features, ref.features[len(PROMPT):], atol=2e-4, rtol=1e-4)
    assert ref.first_token == bonus
    # The commit rides on the next verify: KV rows then equal the fresh prefill's; the step agrees.
    nxt_a = engine.verify("r", [bonus], [-1], path)
    nxt_b = fresh.verify("f", [ref.first_token], [-1])
    a, b = engine._requests["r"].cache, fresh._requests["f"].cache
    assert a.length == b.length == len(committed)
    torch.testing.assert_close(a.k[:, :a.length], b.k[:, :b.length], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(a.v[:, :a.length], b.v[:, :b.length], atol=2e-4, rtol=1e-4)
    assert nxt_a.samples == nxt_b.samples
    assert engine.release(["r"]) == 1 and engine.live_requests == 0


def test_rejected_rows_do_not_leak(target_model):
    """After a round that rejects every draft, the next verify equals plain decoding."""
    m = target_model
    greedy = SamplingParams()
    engine = TargetEngine(m, (1, 14, 27), max_context=512, kv_pool_tokens=4096, max_tree_budget=64)
    first = engine.prefill("r", PROMPT, 32, greedy, "tree", 8).first_token
    wrong = [t for t in range(100, 120) if t != int(plain_logits(m, PROMPT + [first])[-1].argmax())][:8]
    tokens, parents = [first] + wrong, [-1] + [0] * 8
    out = engine.verify("r", tokens, parents)
    path, bonus = walk(tokens, parents, out)
    assert path == [0]
    seq = PROMPT + [first, bonus]
    nxt = engine.verify("r", [bonus], [-1], path)
    assert nxt.samples[0] == int(plain_logits(m, seq)[-1].argmax())
