"""Row-invariant DeepSeek/Kimi forward (interpreter on CPU): equal to the torch path, and a
tree node's logits are bitwise a one-row decode's after its path is committed — the property
that makes greedy speculation exact with bf16 on a GPU."""
import torch

from kernels.rmsnorm_rows import rmsnorm, rmsnorm_reference
from modeling.deepseek_fast import row_invariant_
from modeling.deepseek_weights import load_deepseek
from modeling.llama import causal_mask, tree_mask
from modeling.tree import tree_ancestors, visibility
from scripts.make_tiny_deepseek import TINY, save_tiny

# Kimi-K2 structure, narrower and with fewer experts: the interpreter runs every launch in numpy
SMALL = dict(TINY["kimi_k2"], hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, n_routed_experts=8,
             num_experts_per_tok=2, vocab_size=80)


def test_rmsnorm_rows_matches_reference_and_is_row_invariant(device):
    x = torch.randn(7, 100, device=device) * 3
    w = torch.randn(100, device=device)
    out = rmsnorm(x, w, 1e-6)
    assert (out.double() - rmsnorm_reference(x, w, 1e-6)).abs().max() <= 1e-5 * out.abs().max()
    assert torch.equal(rmsnorm(x[3:4], w, 1e-6)[0], out[3])


@torch.inference_mode()
def test_tree_node_logits_equal_one_row_decode_after_commit(tmp_path):
    save_tiny(tmp_path, SMALL, "bf16")
    model = load_deepseek(tmp_path)
    prompt = [5, 9, 17, 3, 30, 11, 8, 2, 40, 7, 19, 21, 4, 6, 1, 9, 33, 2]
    L = len(prompt)
    parents = [-1, 0, 0, 1, 3, 2, 4]
    tokens = [12, 3, 4, 5, 6, 7, 8]
    depths, anc = tree_ancestors(parents)
    pos = L + torch.from_numpy(depths)
    mask = tree_mask(L, torch.from_numpy(visibility(depths, anc)))

    def prefill():
        cache = model.new_cache(40)
        model(torch.tensor(prompt), torch.arange(L), cache, causal_mask(0, L))
        cache.length = L
        return cache

    ref = model.logits(model(torch.tensor(tokens), pos, prefill(), mask)[0])   # torch path
    row_invariant_(model)
    cache = prefill()
    tree = model.logits(model(torch.tensor(tokens), pos, cache, mask)[0])
    assert (tree - ref).abs().max() <= 1e-4 * ref.abs().max()
    after_tree = cache.kv.clone()
    for i in range(1, len(tokens)):
        c = model.new_cache(40)
        c.kv.copy_(after_tree)
        c.length = L
        path = anc[i, :depths[i] + 1].tolist()
        c.commit(torch.tensor(path[:-1]))  # the ancestors, as a round accepting them would
        one = model.logits(model(torch.tensor(tokens[i:i + 1]), torch.tensor([L + int(depths[i])]), c,
                                 causal_mask(c.length, 1))[0])
        assert torch.equal(one[0], tree[i]), f"node {i}"
