"""Row-invariant DeepSeek/Kimi forward (interpreter on CPU): equal to the torch path, and a
tree node's logits are bitwise a one-row decode's after its path is committed — the property
that makes greedy speculation exact with bf16 on a GPU."""
import conftest  # noqa: F401  (a spawned TP worker imports this module: interpreter + numpy patch)
import pytest
import torch

from specdec_kernels.rmsnorm_rows import rmsnorm, rmsnorm_reference
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
def test_tree_node_logits_equal_one_row_decode_after_commit(tmp_path, device):
    save_tiny(tmp_path, SMALL, "bf16")
    model = load_deepseek(tmp_path, device)

    def t(x):
        return torch.tensor(x, device=device)

    prompt = [5, 9, 17, 3, 30, 11, 8, 2, 40, 7, 19, 21, 4, 6, 1, 9, 33, 2]
    L = len(prompt)
    parents = [-1, 0, 0, 1, 3, 2, 4]
    tokens = [12, 3, 4, 5, 6, 7, 8]
    depths, anc = tree_ancestors(parents)
    pos = L + torch.from_numpy(depths).to(device)
    mask = tree_mask(L, torch.from_numpy(visibility(depths, anc)).to(device))

    def prefill():
        cache = model.new_cache(40)
        model(t(prompt), torch.arange(L, device=device), cache, causal_mask(0, L, device))
        cache.length = L
        return cache

    ref = model.logits(model(t(tokens), pos, prefill(), mask)[0])   # torch path
    row_invariant_(model)
    cache = prefill()
    tree = model.logits(model(t(tokens), pos, cache, mask)[0])
    assert (tree - ref).abs().max() <= 1e-4 * ref.abs().max()
    after_tree = cache.kv.clone()
    for i in range(1, len(tokens)):
        c = model.new_cache(40)
        c.kv.copy_(after_tree)
        c.length = L
        path = anc[i, :depths[i] + 1].tolist()
        c.commit(t(path[:-1]))  # the ancestors, as a round accepting them would
        one = model.logits(model(t(tokens[i:i + 1]), t([L + int(depths[i])]), c, causal_mask(c.length, 1, device))[0])
        assert torch.equal(one[0], tree[i]), f"node {i}"


def _in_worker():
    """Runs first in each TP worker; importing this module there set up the interpreter."""


@pytest.mark.slow  # ~15 s in the interpreter; the CPU TP path is covered in the fast tier
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks (gloo); GPUs: test_tp2_on_two_gpus_nccl")
@torch.inference_mode()
def test_tp2_row_invariant_matches_tp1(tmp_path):
    """The row-invariant kernels on each of two ranks (per-head absorption weights taken after
    sharding) give TP=1's logits."""
    from modeling.tp import launch

    save_tiny(tmp_path, SMALL, "fp8")

    def logits(model):
        cache = model.new_cache(24)
        h, _ = model(torch.arange(3, 15), torch.arange(12), cache, causal_mask(0, 12))
        cache.length = 12
        depths, anc = tree_ancestors([-1, 0, 0, 1])
        t, _ = model(torch.tensor([4, 5, 6, 7]), 12 + torch.from_numpy(depths), cache,
                     tree_mask(12, torch.from_numpy(visibility(depths, anc))))
        return model.logits(torch.cat([h, t]))

    want = logits(row_invariant_(load_deepseek(tmp_path)))
    driver = launch(str(tmp_path), 2, row_invariant=True, worker_init=_in_worker)
    try:
        got = logits(driver)
    finally:
        driver.stop()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@torch.inference_mode()
def test_absorption_runs_every_head_in_one_launch(tmp_path, device):
    save_tiny(tmp_path, SMALL, "bf16")
    attn = row_invariant_(load_deepseek(tmp_path, device)).model.layers[0].self_attn
    q = torch.randn(5, 2, 48, device=device)[..., :16]  # [T, h, N] as the strided view of q it is in serving
    o = torch.randn(5, 2, 32, device=device)            # [T, h, C]
    w_uk, w_uv = attn.absorbed()
    got_q, got_o = attn.absorb_q(q), attn.expand_v(o)
    want_q, want_o = torch.einsum("thn,hnc->thc", q, w_uk), torch.einsum("thc,hvc->thv", o, w_uv)
    assert got_q.shape == want_q.shape and got_o.shape == want_o.shape
    assert (got_q - want_q).abs().max() <= 1e-5 * want_q.abs().max()
    assert (got_o - want_o).abs().max() <= 1e-5 * want_o.abs().max()
    assert attn._w_uk.numel() + attn._w_uv.numel() == attn.kv_b_proj.weight.numel()  # 1× kv_b, not h×


@torch.inference_mode()
def test_row_invariant_path_with_weights_kept_in_fp8(tmp_path, device):
    save_tiny(tmp_path, SMALL, "fp8")
    seq = torch.arange(3, 15, device=device)
    out = []
    for keep in (False, True):
        model = row_invariant_(load_deepseek(tmp_path, device, keep_fp8=keep))
        out.append(model.logits(model(seq, torch.arange(12, device=device), model.new_cache(12),
                                      causal_mask(0, 12, device))[0]))
    assert torch.equal(out[0], out[1])


def test_capturable_only_when_every_moe_runs_grouped():
    """A CUDA graph needs a forward without host syncs: the row-invariant model whose experts stack
    is capturable; the torch model, or one whose experts are of mixed kinds (the per-expert loop reads
    group sizes on the host), is not — the target service then verifies eagerly."""
    from modeling.deepseek import DeepseekConfig, DeepseekModel
    from modeling.deepseek_fast import capturable, row_invariant_
    from modeling.deepseek_weights import FP8Linear, quantize_fp8
    from scripts.make_tiny_deepseek import TINY

    cfg = DeepseekConfig.from_dict(dict(TINY["kimi_k2"]))
    assert not capturable(DeepseekModel(cfg))
    assert capturable(row_invariant_(DeepseekModel(cfg)))
    mixed = DeepseekModel(cfg)
    moe = next(layer.mlp for layer in mixed.model.layers if hasattr(layer.mlp, "experts"))
    qw, sc = quantize_fp8(moe.experts[0].down_proj.weight.data.float(), 16)
    moe.experts[0].down_proj = FP8Linear(qw, sc, (16, 16), torch.float32)
    assert not capturable(row_invariant_(mixed))


@torch.inference_mode()
def test_weights_replaced_after_switching_are_used(tmp_path, device):
    """load_state_dict (assign or in place) after ``row_invariant_``: the fast path follows the new weights —
    the absorbed W_UK / W_UV and the stacked [gate; up] are rebuilt, never read stale."""
    save_tiny(tmp_path, SMALL, "bf16")
    tokens, pos = torch.tensor([5, 9, 17, 3], device=device), torch.arange(4, device=device)

    def logits(m):
        return m.logits(m(tokens, pos, m.new_cache(8), causal_mask(0, 4, device))[0])

    fast = row_invariant_(load_deepseek(tmp_path, device))
    before = logits(fast)
    other = load_deepseek(tmp_path, device)
    g = torch.Generator().manual_seed(7)
    sd = {k: (v + torch.randn(v.shape, generator=g).to(device, v.dtype) * v.float().std().to(v.dtype) * 0.5
              if k.endswith(("kv_b_proj.weight", "shared_experts.gate_proj.weight", "mlp.up_proj.weight")) else v)
          for k, v in other.state_dict().items()}
    other.load_state_dict(sd)
    want = logits(other)
    assert (want - before).abs().max() > 1e-2 * before.abs().max()  # the edit changes the logits
    for assign in (True, False):
        fast = row_invariant_(load_deepseek(tmp_path, device))
        fast.load_state_dict(sd, assign=assign)
        got = logits(fast)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), f"assign={assign}"
    # a replacement at the freed address of the tensor it replaces: still seen (the old storage is held)
    fast = row_invariant_(load_deepseek(tmp_path, device))
    logits(fast)
    kvb = {k: v for k, v in sd.items() if k.endswith("kv_b_proj.weight")}
    for name, new in kvb.items():
        lin = fast.get_submodule(name.rsplit(".", 1)[0])
        lin.weight.data = lin.weight.data.clone()
        fresh = torch.empty_like(lin.weight)
        fresh.copy_(new)
        lin.weight.data = fresh
    other2 = load_deepseek(tmp_path, device)
    other2.load_state_dict({**other2.state_dict(), **kvb})
    want2 = logits(other2)
    assert (logits(fast) - want2).abs().max() <= 1e-4 * want2.abs().max()


@torch.no_grad()  # (not inference mode: its tensors have no version counter, so an in-place write is unseen)
def test_fp8_kv_b_scales_changed_after_switching_are_used(tmp_path, device):
    save_tiny(tmp_path, SMALL, "fp8")
    tokens, pos = torch.tensor([5, 9, 17, 3], device=device), torch.arange(4, device=device)

    def logits(m):
        return m.logits(m(tokens, pos, m.new_cache(8), causal_mask(0, 4, device))[0])

    ref = load_deepseek(tmp_path, device, keep_fp8=True)
    fast = row_invariant_(load_deepseek(tmp_path, device, keep_fp8=True))
    logits(fast)
    for m in (ref, fast):
        lin = m.model.layers[0].self_attn.kv_b_proj
        assert type(lin).__name__ == "FP8Linear"
        lin.scale_inv.mul_(2)  # in place: the version moves
        lin2 = m.model.layers[1].self_attn.kv_b_proj
        lin2.scale_inv = lin2.scale_inv * 3  # replaced
    want = logits(ref)
    assert (logits(fast) - want).abs().max() <= 1e-4 * want.abs().max()
