"""Several requests' prefill pieces and trees in one row-invariant DeepSeek/Kimi forward over a
paged latent pool (modeling/mla_batch.py): each request's logits are bitwise its solo forward's over
its own contiguous ``MLACache``, whatever else shares the forward; commits move only its rows."""
import numpy as np
import pytest
import torch

from modeling.deepseek_fast import row_invariant_
from modeling.deepseek_weights import load_deepseek
from modeling.kv_cache import PagedKVPool
from modeling.llama import causal_mask, tree_mask
from modeling.mla_batch import MLABatch, MLATree
from modeling.tree import tree_ancestors, visibility
from scripts.make_tiny_deepseek import save_tiny
from test_deepseek_fast import SMALL


def chain(n):
    return tree_ancestors([-1] + list(range(n - 1)))


@torch.inference_mode()
def test_batched_paged_forward_equals_each_requests_solo_forward(tmp_path, device):
    save_tiny(tmp_path, SMALL, "bf16")
    model = row_invariant_(load_deepseek(tmp_path, device))
    cfg = model.cfg
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    prompts = [[5, 9, 17, 3, 30, 11, 8, 2, 40, 7], [4, 6, 1, 9, 33], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
    trees = [([-1, 0, 0, 1, 3], [12, 3, 4, 5, 6]), ([-1, 0, 1], [7, 8, 9]), ([-1, 0, 0, 0, 2, 2], [1, 2, 3, 4, 5, 6])]

    # each request alone over its contiguous cache: prefill, then its tree
    want = []
    for prompt, (parents, toks) in zip(prompts, trees):
        L = len(prompt)
        c = model.new_cache(64)
        model(torch.tensor(prompt, device=device), torch.arange(L, device=device), c, causal_mask(0, L, device))
        c.length = L
        d, a = tree_ancestors(parents)
        want.append(model.logits(model(torch.tensor(toks, device=device), L + torch.from_numpy(d).to(device), c,
                                       tree_mask(L, torch.from_numpy(visibility(d, a)).to(device)))[0]))

    # all together over one paged latent pool (pages of 64 rows, the first request given a later page)
    pool = PagedKVPool(cfg.num_hidden_layers, 64 * 8, 1, width, device, model.lm_head.weight.dtype, 64, latent=True)
    spare = pool.allocate(64)
    caches = [pool.allocate(64) for _ in prompts]
    pool.free(spare)
    assert pool.v is None and pool.k.shape == (cfg.num_hidden_layers, 64 * 9, width)
    pre = MLABatch(pool, [MLATree(p, *chain(len(p)), c) for p, c in zip(prompts, caches)], device)
    model(pre.tokens, pre.positions, pre, pre)
    for p, c in zip(prompts, caches):
        c.commit(torch.arange(len(p)))
    batch = MLABatch(pool, [MLATree(toks, *tree_ancestors(parents), c) for (parents, toks), c in zip(trees, caches)],
                     device)
    got = model.logits(model(batch.tokens, batch.positions, batch, batch)[0])
    r0 = 0
    for w in want:
        assert torch.equal(got[r0:r0 + len(w)], w)
        r0 += len(w)

    # a commit of the first request's path moves only its rows; a one-row decode after it equals its node
    d, a = tree_ancestors(trees[0][0])
    before = pool.k.clone()
    caches[0].commit(torch.tensor(a[3, :d[3]].tolist()))        # node 3's ancestors (root, 1)
    others = np.concatenate([c.rows(np.arange(c.capacity)) for c in caches[1:]])
    assert torch.equal(pool.k[:, others], before[:, others])
    one = MLABatch(pool, [MLATree([trees[0][1][3]], *chain(1), caches[0])], device)
    one_logits = model.logits(model(one.tokens, one.positions, one, one)[0])
    assert one.positions.tolist() == [len(prompts[0]) + int(d[3])]
    assert torch.equal(one_logits[0], got[3])


@pytest.mark.cpu_slow  # the interpreter runs every launch of both engines; in every GPU run
@pytest.mark.parametrize("fast", ["eager", "graphs"])
@torch.inference_mode()
def test_target_engine_fast_path_for_a_deepseek_target_matches_the_eager_engine(tmp_path, device, fast):
    """TargetEngine(fast="eager", and "graphs" on a GPU) with a Kimi-style target: the paged latent
    pool, the prefill in chunks as chains and each round's tree through ``RowInvariantDeepseek`` (the
    graph-ready forward: device inputs only) give the same greedy samples as the per-request engine
    (fast="off") round after round — bf16 on a GPU — with commits inside the next forward, two
    requests batched, and the pool back to idle after release."""
    from modeling.acceptance import resolve
    from modeling.sampling import SamplingParams
    from target_service.engine import TargetEngine, VerifyItem

    if fast == "graphs" and device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    save_tiny(tmp_path, SMALL, "bf16")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # (numpy has no bf16 matmul)
    model = row_invariant_(load_deepseek(tmp_path, device, dtype))
    engines = [TargetEngine(model, (0,), 256, 1024, 16, fast=f, kv_page_rows=64, prefill_chunk=16)
               for f in ("off", fast)]
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = {r: torch.randint(0, SMALL["vocab_size"], (n,), generator=g).tolist() for r, n in (("a", 21), ("b", 9))}
    rounds = [[([-1, 0, 0, 1], 4), ([-1, 0, 1], 3)], [([-1], 1), ([-1, 0, 0, 2, 2], 5)]]
    outs = []
    for e in engines:
        bonus = {r: e.prefill(r, p, 24, SamplingParams(), "tree", 8).first_token for r, p in prompts.items()}
        commit, got = {r: None for r in prompts}, []
        for trees in rounds:
            items = []
            for r, (parents, n) in zip(prompts, trees):
                toks = [bonus[r]] + torch.randperm(SMALL["vocab_size"], generator=torch.Generator().manual_seed(n))[
                    :n - 1].tolist()
                items.append(VerifyItem(r, toks, parents, commit[r]))
            res = e.verify_batch(items)
            for it, v in zip(items, res):
                got.append(v.samples)
                commit[it.request_id], bonus[it.request_id] = resolve(it.tokens, it.parents, v.samples)
        outs.append(got)
        e.release(list(prompts))
    assert outs[0] == outs[1]
    fast = engines[1]
    assert fast.pool.v is None and type(fast._tree_forward.forward).__name__ == "RowInvariantDeepseek"
    assert any(decode == 4 + 3 for decode, _, _ in fast.step_log)  # the first round: both trees in one forward
    assert fast.pool.free_pages == fast.pool.pages
