"""DeepSeek-V3 / Kimi-K2 target (MLA + MoE) equals an independent oracle, transformers'
DeepseekV3ForCausalLM (test-only dependency), on tiny random checkpoints written in the HF
layout (bf16 and FP8 block-scaled) and read back through our loader: prefill, decode, tree
verify and commit, fp32 logits within 1e-4."""
import json
import shutil

import numpy as np
import pytest
import torch

from modeling.deepseek import DeepseekConfig, MLACache
from modeling.deepseek_weights import dequantize_fp8, load_deepseek, quantize_fp8
from modeling.llama import causal_mask, tree_mask
from modeling.tree import tree_ancestors, visibility
from scripts.make_tiny_deepseek import TINY, save_tiny


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one torch thread is faster and immune to a loaded CI machine's
    oversubscription (two OpenMP threads spin-wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


transformers = pytest.importorskip("transformers")
TOL = 1e-4
CASES = [("deepseek_v3", "bf16"), ("deepseek_v3", "fp8"), ("kimi_k2", "bf16"), ("kimi_k2", "fp8")]


def hf_oracle(name: str, fmt: str, path, truth: dict):
    """DeepSeek-V3 bf16: HF's own loader reads our files (checks the tensor names
    independently). Otherwise the float32 weights the files encode: HF cannot dequantise block
    FP8 on CPU, and it has no expert-stacking rule for model_type kimi_k2."""
    if fmt == "bf16" and name == "deepseek_v3":
        model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                         output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        return model.eval()
    c = dict(TINY[name])
    rs = c.pop("rope_scaling")
    for k in ("model_type", "scoring_func", "topk_method"):
        c.pop(k)
    rope = dict(rope_type="yarn", rope_theta=c.pop("rope_theta"), **{k: v for k, v in rs.items() if k != "type"})
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**c, rope_parameters=rope)).eval()
    state = {k: v for k, v in truth.items() if ".experts." not in k}
    for i in range(c["first_k_dense_replace"], c["num_hidden_layers"]):  # HF stacks experts
        p, E = f"model.layers.{i}.mlp.experts.", range(c["n_routed_experts"])
        state[p + "gate_up_proj"] = torch.stack([torch.cat([truth[f"{p}{e}.gate_proj.weight"],
                                                            truth[f"{p}{e}.up_proj.weight"]]) for e in E])
        state[p + "down_proj"] = torch.stack([truth[f"{p}{e}.down_proj.weight"] for e in E])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{f}" for n, f in CASES])
def pair(request, tmp_path_factory):
    name, fmt = request.param
    path = tmp_path_factory.mktemp(f"{name}-{fmt}")
    truth = save_tiny(path, name, fmt, seed=len(name) + len(fmt))
    return name, load_deepseek(path), hf_oracle(name, fmt, path, truth)


@torch.inference_mode()
def oracle_logits(hf, seq: list[int]) -> torch.Tensor:
    """Last-position logits [V] of a full causal forward over seq (no cache)."""
    return hf(torch.tensor([seq])).logits[0, -1].float()


def check(got, want, errors):
    err = (got - want).abs().max().item()
    errors.append(err)
    assert want.std() > 0.5, "oracle logits too flat for the tolerance to mean anything"
    assert err <= TOL, f"max |Δlogit| {err:.3g} > {TOL}"


@torch.inference_mode()
def test_prefill_decode_and_tree_verify_match_oracle(pair):
    name, ours, hf = pair
    V = ours.cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, V, (20,), generator=g).tolist()  # > original_max_position_embeddings: YaRN matters
    cache = ours.new_cache(64)
    errors = []
    # prefill: every position against the oracle's full forward
    hidden, _ = ours(torch.tensor(seq), torch.arange(len(seq)), cache, causal_mask(0, len(seq)))
    cache.length = len(seq)
    full = hf(torch.tensor([seq])).logits[0].float()
    check(ours.logits(hidden), full, errors)
    # decode: one token at a time against the committed latent rows
    for _ in range(3):
        seq.append(int(torch.randint(0, V, (1,), generator=g)))
        L = cache.length
        hidden, _ = ours(torch.tensor(seq[-1:]), torch.tensor([L]), cache, causal_mask(L, 1))
        cache.commit(torch.tensor([0]))
        check(ours.logits(hidden)[0], oracle_logits(hf, seq), errors)
    # tree verify: node i's logits = the oracle's after prefix + i's root path
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 0]
    tokens = [seq.pop()] + torch.randint(0, V, (len(parents) - 1,), generator=g).tolist()
    cache.length -= 1  # the last decoded token becomes the tree's root (the pending bonus)
    depths, anc = tree_ancestors(parents)
    L = cache.length
    hidden, _ = ours(torch.tensor(tokens), L + torch.from_numpy(depths), cache,
                     tree_mask(L, torch.from_numpy(visibility(depths, anc))))
    logits = ours.logits(hidden)
    for i in range(len(parents)):
        path = [tokens[int(j)] for j in anc[i, :depths[i] + 1]]
        check(logits[i], oracle_logits(hf, seq + path), errors)
    # commit the path to node 7 (0 → 2 → 6 → 7), then decode after it
    keep = anc[7, :depths[7] + 1].tolist()
    cache.commit(torch.tensor(keep))
    seq += [tokens[j] for j in keep]
    seq.append(3)
    L = cache.length
    hidden, _ = ours(torch.tensor([3]), torch.tensor([L]), cache, causal_mask(L, 1))
    check(ours.logits(hidden)[0], oracle_logits(hf, seq), errors)
    print(f"{name}: max |Δlogit| over {len(errors)} checks = {max(errors):.2e}")


@torch.inference_mode()
def test_taps_are_decoder_layer_outputs(pair):
    _, ours, hf = pair
    seq = list(range(3, 15))
    cache = ours.new_cache(16)
    _, feats = ours(torch.tensor(seq), torch.arange(12), cache, causal_mask(0, 12), taps=(0, 1))
    hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states  # [0] = embeddings
    H = ours.cfg.hidden_size
    assert (feats[:, :H] - hs[1][0]).abs().max() <= TOL
    assert (feats[:, H:] - hs[2][0]).abs().max() <= TOL  # (HF's last entry is after the final norm)


def test_correction_bias_changes_selection_but_not_weights(pair):
    """The tiny configs are sensitive to the bias (else the oracle could not catch its misuse)."""
    _, ours, _ = pair
    moe = ours.model.layers[1].mlp
    x = torch.randn(64, ours.cfg.hidden_size)
    ids, w = moe.route(x)
    bias = moe.gate.e_score_correction_bias.clone()
    moe.gate.e_score_correction_bias.zero_()
    ids0, _ = moe.route(x)
    moe.gate.e_score_correction_bias.copy_(bias)
    assert not torch.equal(ids.sort(-1).values, ids0.sort(-1).values)
    scores = torch.sigmoid(x @ moe.gate.weight.T).gather(1, ids)
    torch.testing.assert_close(w, scores / scores.sum(-1, keepdim=True) * ours.cfg.routed_scaling_factor)


def test_softmax_scale_of_the_real_configs():
    """DOMAIN §5: 0.1352 (DeepSeek-V3, YaRN factor 40) and 0.1309 (Kimi-K2, factor 32)."""
    base = {k: v for k, v in TINY["deepseek_v3"].items() if k not in ("rope_scaling",)}
    base.update(qk_nope_head_dim=128, qk_rope_head_dim=64)
    v3 = DeepseekConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0,
                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}})
    k2 = DeepseekConfig.from_dict({**base, "model_type": "kimi_k2", "rope_scaling": {
        "type": "yarn", "factor": 32, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}})
    assert abs(v3.softmax_scale - 0.13523) < 1e-4 and abs(k2.softmax_scale - 0.13086) < 1e-4
    with pytest.raises(ValueError, match="model_type"):
        DeepseekConfig.from_dict({**base, "model_type": "llama"})


def test_fp8_block_dequantisation():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g) * torch.rand(300, 1, generator=g) * 10  # rows of different scales
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    got = dequantize_fp8(q, s)
    want = torch.empty(300, 200)
    for r in range(300):  # per element: its block is (r // 128, c // 128)
        for c0 in (0, 128):
            want[r, c0:c0 + 128] = q[r, c0:c0 + 128].float() * s[r // 128, c0 // 128]
    assert torch.equal(got, want)
    assert ((got - w).abs() <= w.abs() * 2 ** -3 + s.max() * 2 ** -9).all()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="scale grid"):
        dequantize_fp8(q, s[:2])
    s2 = torch.rand(5, 7, generator=g)  # non-square (64, 32) blocks
    r, c = torch.arange(300)[:, None], torch.arange(200)[None, :]
    assert torch.equal(dequantize_fp8(q, s2, (64, 32)), q.float() * s2[r // 64, c // 32])


def test_loader_names_missing_and_misshaped_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "ok"
    save_tiny(src, "deepseek_v3", "bf16")
    bad = tmp_path / "missing"
    shutil.copytree(src, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.self_attn.kv_b_proj.weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match=r"model\.layers\.2\.self_attn\.kv_b_proj\.weight.*\[128, 32\]"):
        load_deepseek(bad)
    bad = tmp_path / "shape"
    shutil.copytree(src, bad)
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    shard = bad / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight has shape \[24, 63\].*implies \[24, 64\]"):
        load_deepseek(bad)


def test_loader_names_tensors_of_a_wrong_dtype_or_scale_grid_and_unreadable_files(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "ok"
    save_tiny(src, "kimi_k2", "fp8")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.o_proj.weight"

    def broken(tag, edit):
        bad = tmp_path / tag
        shutil.copytree(src, bad)
        shard = bad / index["weight_map"][name]
        tensors = load_file(str(shard))
        edit(tensors)
        save_file(tensors, str(shard))
        return bad

    for dtype in (torch.int32, torch.float8_e5m2):  # an integer weight; an FP8 kind with no block-scale rule here
        bad = broken(str(dtype).split(".")[1], lambda t: t.update({name: t[name].float().to(dtype)}))
        with pytest.raises(ValueError, match=rf"tensor {name} has dtype {dtype}"):
            load_deepseek(bad)
    bad = broken("grid", lambda t: t.update({name + "_scale_inv": torch.ones(3, 3)}))
    for keep in (False, True):  # kept in FP8 too: refused at load, not at the first forward
        with pytest.raises(ValueError, match=rf"{name}_scale_inv has shape \[3, 3\]; FP8 tensor {name}"):
            load_deepseek(bad, keep_fp8=keep)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"  # ±inf in one group made its score NaN
    for value in (float("inf"), float("-inf"), float("nan")):
        bad = tmp_path / f"bias{value}"
        shutil.copytree(src, bad)
        shard = bad / index["weight_map"][bias]
        tensors = load_file(str(shard))
        tensors[bias][3] = value
        save_file(tensors, str(shard))
        with pytest.raises(ValueError, match=rf"tensor {bias} has 1 non-finite values"):
            load_deepseek(bad)
    bad = tmp_path / "truncated"
    shutil.copytree(src, bad)
    shard = bad / index["weight_map"][name]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"cannot read tensor .* from .*{shard.name}"):
        load_deepseek(bad)


def test_cache_commit_gathers_the_accepted_rows():
    c = MLACache(2, 10, 3, "cpu", torch.float32)
    c.length = 2
    rows = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    for layer in range(2):
        assert c.write(layer, rows[layer]).shape == (7, 3)
    c.commit(torch.tensor([0, 2, 3]))
    assert c.length == 5 and torch.equal(c.kv[:, 2:5], rows[:, [0, 2, 3]])
    with pytest.raises(ValueError, match="capacity"):
        c.write(0, torch.zeros(6, 3))
    np.testing.assert_equal(c.nbytes, 2 * 10 * 3 * 4)


def test_target_loader_switches_on_model_type(tmp_path):
    from modeling.deepseek import DeepseekModel
    from modeling.defaults import drafter_config
    from modeling.targets import load_target_model, model_type

    save_tiny(tmp_path, "kimi_k2", "bf16")
    assert model_type(tmp_path) == "kimi_k2" and model_type(None) == "gguf"
    model = load_target_model(tmp_path, "cpu", torch.float32)
    assert isinstance(model, DeepseekModel) and model.cfg.eos_token_ids == (1, 2)
    fresh = drafter_config(model.cfg, tmp_path / "no-drafter", fresh=True)
    assert fresh.hidden_size == model.cfg.hidden_size and fresh.target_layer_ids[-1] < model.cfg.num_hidden_layers


def test_config_rejects_an_unsatisfiable_router():
    base = dict(TINY["deepseek_v3"])
    with pytest.raises(ValueError, match="16 experts in 3 groups"):
        DeepseekConfig.from_dict({**base, "n_group": 3})
    with pytest.raises(ValueError, match="top-9 experts"):
        DeepseekConfig.from_dict({**base, "topk_group": 2, "num_experts_per_tok": 9})
    assert DeepseekConfig.from_dict({**base, "quantization_config": {"weight_block_size": [64, 32]}}).fp8_block == (64, 32)
    with pytest.raises(ValueError, match="moe_layer_freq 2"):
        DeepseekConfig.from_dict({**base, "moe_layer_freq": 2})


def test_config_names_a_missing_or_unusable_field():
    base = dict(TINY["deepseek_v3"])
    with pytest.raises(ValueError, match=r"config.json lacks \['kv_lora_rank'\]"):
        DeepseekConfig.from_dict({k: v for k, v in base.items() if k != "kv_lora_rank"})
    for field, value, what in [("n_group", 0, "a positive int"), ("topk_group", 0, "a positive int"),
                               ("kv_lora_rank", "32", "a positive int"), ("qk_rope_head_dim", 3, "an even"),
                               ("num_experts_per_tok", 0, "a positive int"), ("eos_token_id", "1", "token ids"),
                               ("q_lora_rank", 0, "null or a positive int")]:
        with pytest.raises(ValueError, match=rf"config.json's {field if field != 'eos_token_id' else 'eos_token_ids'} "
                                             rf"must be {what}"):
            DeepseekConfig.from_dict({**base, field: value})
    with pytest.raises(ValueError, match=r"rope_scaling \(yarn\) lacks \['factor'\]"):
        DeepseekConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 64}})
    assert DeepseekConfig.from_dict({**base, "n_group": None, "topk_group": None}).n_group == 1  # null: the default


def test_taps_outside_the_model_are_refused(pair):
    _, ours, _ = pair
    with pytest.raises(ValueError, match=r"decoder layers in \[0, 3\)"):
        ours(torch.tensor([1]), torch.tensor([0]), ours.new_cache(2), causal_mask(0, 1), taps=(1, 3))


@torch.inference_mode()
def test_fp8_weights_kept_in_fp8_give_the_same_logits(tmp_path):
    from modeling.deepseek_weights import FP8Linear

    save_tiny(tmp_path, "deepseek_v3", "fp8")
    plain, kept = load_deepseek(tmp_path), load_deepseek(tmp_path, keep_fp8=True)
    fp8 = [m for m in kept.modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 3 * 5 + 3 + 2 * (16 + 1) * 3  # attention ×5 per layer, dense MLP, experts + shared
    assert sum(m.w_u8.nbytes for m in fp8) * 4 == sum(m.weight.nbytes for m in fp8)  # 1 byte vs fp32's 4
    seq = torch.arange(3, 15)
    out = [m.logits(m(seq, torch.arange(12), m.new_cache(12), causal_mask(0, 12))[0]) for m in (plain, kept)]
    assert torch.equal(out[0], out[1])


def test_fp8_share_of_a_rank_cut_on_block_boundaries():
    from modeling.deepseek_weights import take_fp8
    from modeling.tp import take

    w = torch.randn(512, 384) * torch.rand(512, 1)
    q, s = quantize_fp8(w)
    for rank in (0, 1):
        q1, s1 = take_fp8(q, s, (0, 0), rank, 2, (128, 128))
        assert torch.equal(dequantize_fp8(q1, s1), take(dequantize_fp8(q, s), (0, 0), rank, 2))
    assert take_fp8(q, s, (1, 0), 0, 2, (128, 128)) is None  # 192 columns: not on a block edge
