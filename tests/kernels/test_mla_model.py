"""The DeepSeek/Kimi target with its attention in the Triton MLA kernel equals the torch
path (interpreter on CPU, or the GPU): prefill, decode and tree verify logits, fp32."""
import torch

from modeling.deepseek_weights import load_deepseek
from modeling.llama import causal_mask, tree_mask
from modeling.tree import tree_ancestors, visibility
from scripts.make_tiny_deepseek import save_tiny


@torch.inference_mode()
def run(model, dev):
    def t(x):
        return torch.tensor(x, device=dev)

    cache = model.new_cache(48)
    seq = [5, 9, 17, 3, 30, 11, 8, 2, 40, 7, 19, 21, 4, 6, 1, 9, 33, 2, 5, 70]
    T = len(seq)
    h, f = model(t(seq), torch.arange(T, device=dev), cache, causal_mask(0, T, dev), (1,))
    cache.length = T
    out = [model.logits(h), f]
    h, _ = model(t([12]), t([T]), cache, causal_mask(T, 1, dev))
    cache.commit(t([0]))
    out.append(model.logits(h))
    parents = [-1, 0, 0, 1, 3, 2, 0, 4]
    depths, anc = tree_ancestors(parents)
    L = cache.length
    h, _ = model(t([3, 4, 5, 6, 7, 8, 9, 10]), L + torch.from_numpy(depths).to(dev), cache,
                 tree_mask(L, torch.from_numpy(visibility(depths, anc)).to(dev)))
    out.append(model.logits(h))
    return out


def test_kernel_attention_equals_torch_attention(tmp_path, device):
    save_tiny(tmp_path, "kimi_k2", "bf16")  # kv_lora 64, rope 16, 4 heads: kernel-sized
    model = load_deepseek(tmp_path, device)
    want = run(model, device)
    model.attention = "triton"
    got = run(model, device)
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max(), (g - w).abs().max()
