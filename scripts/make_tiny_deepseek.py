"""Save a small random DeepSeek-V3 / Kimi-K2 checkpoint in the HF layout (config.json, two
safetensors shards + index), in bf16 or FP8 (e4m3 with 128×128 block scales, as DeepSeek-V3's
public weights). For tests and smoke runs; the weights are random, not a trained model.

    python3 scripts/make_tiny_deepseek.py OUT_DIR [--config deepseek_v3|kimi_k2] [--format bf16|fp8] [--seed 0]

``save_tiny`` returns the float32 weights the files encode (after bf16 rounding or FP8
quantisation), to give an oracle exactly the same network.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch

# Tiny configs with the real models' structure; widths chosen so FP8 weights span partial
# 128×128 blocks (dims 160, 200). deepseek_v3: 4 groups / top-2 groups, YaRN with
# mscale ≠ mscale_all_dim (exercises the cos/sin multiplier); kimi_k2: 1 group, 32 experts,
# top-8, Kimi-K2's rope values.
TINY = {
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=96, hidden_size=64, intermediate_size=200, moe_intermediate_size=24,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=640, tie_word_embeddings=False,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=16, beta_fast=32,
                          beta_slow=1, mscale=0.9, mscale_all_dim=0.8),
        bos_token_id=0, eos_token_id=1),
    "kimi_k2": dict(
        model_type="kimi_k2", vocab_size=112, hidden_size=160, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        n_routed_experts=32, n_group=1, topk_group=1, num_experts_per_tok=8, n_shared_experts=1,
        routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=512, tie_word_embeddings=False,
        rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=16, beta_fast=1.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=0, eos_token_id=[1, 2]),
}


def random_state(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights with HF checkpoint names. Linear weights ~ N(0, 1/in) so activations and
    logits are O(1) (a tolerance of 1e-4 then means something); norm weights 1 ± 0.2; a
    correction bias large enough to change which experts are chosen."""
    g = torch.Generator().manual_seed(seed)

    def lin(o, i):
        return torch.randn(o, i, generator=g) / i ** 0.5

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)

    H, h = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    s = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], H, generator=g),
         "model.norm.weight": norm(H), "lm_head.weight": lin(c["vocab_size"], H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = norm(H)
        s[p + "post_attention_layernorm.weight"] = norm(H)
        a = p + "self_attn."
        if c.get("q_lora_rank"):
            s[a + "q_a_proj.weight"] = lin(c["q_lora_rank"], H)
            s[a + "q_a_layernorm.weight"] = norm(c["q_lora_rank"])
            s[a + "q_b_proj.weight"] = lin(h * qk, c["q_lora_rank"])
        else:
            s[a + "q_proj.weight"] = lin(h * qk, H)
        s[a + "kv_a_proj_with_mqa.weight"] = lin(c["kv_lora_rank"] + c["qk_rope_head_dim"], H)
        s[a + "kv_a_layernorm.weight"] = norm(c["kv_lora_rank"])
        s[a + "kv_b_proj.weight"] = lin(h * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        s[a + "o_proj.weight"] = lin(H, h * c["v_head_dim"])
        m = p + "mlp."
        mlps = []
        if i < c["first_k_dense_replace"]:
            mlps.append((m, c["intermediate_size"]))
        else:
            s[m + "gate.weight"] = lin(c["n_routed_experts"], H)
            s[m + "gate.e_score_correction_bias"] = 0.3 * torch.randn(c["n_routed_experts"], generator=g)
            mlps += [(f"{m}experts.{e}.", c["moe_intermediate_size"]) for e in range(c["n_routed_experts"])]
            if c.get("n_shared_experts"):
                mlps.append((m + "shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"]))
        for q, inter in mlps:
            s[q + "gate_proj.weight"], s[q + "up_proj.weight"] = lin(inter, H), lin(inter, H)
            s[q + "down_proj.weight"] = lin(H, inter)
    return s


def fp8_quantised(name: str) -> bool:
    """DeepSeek-V3's FP8 set: the linear weights inside decoder layers except the router."""
    return name.startswith("model.layers.") and name.endswith("proj.weight") or \
        name.endswith("proj_with_mqa.weight")


def save_tiny(out: str | pathlib.Path, config: str | dict = "deepseek_v3", fmt: str = "bf16",
              seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the checkpoint to ``out`` and return the float32 weights it encodes."""
    from safetensors.torch import save_file

    from modeling.deepseek_weights import dequantize_fp8, quantize_fp8

    c = dict(TINY[config] if isinstance(config, str) else config)
    if fmt not in ("bf16", "fp8"):
        raise ValueError(f"format must be bf16 or fp8, got {fmt!r}")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files, truth = {}, {}
    for name, w in random_state(c, seed).items():
        if fmt == "fp8" and fp8_quantised(name):
            q, scale = quantize_fp8(w)
            files[name], files[name + "_scale_inv"] = q, scale
            truth[name] = dequantize_fp8(q, scale)
        elif name.endswith("e_score_correction_bias"):
            files[name] = truth[name] = w  # float32 in the real checkpoints
        else:
            files[name] = w.to(torch.bfloat16)
            truth[name] = files[name].float()
    if fmt == "fp8":
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(c, indent=1))
    names = sorted(files)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: files[k].contiguous() for k in keys}, str(out / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return truth


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--config", choices=sorted(TINY), default="deepseek_v3")
    p.add_argument("--format", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    save_tiny(a.out, a.config, a.format, a.seed)
    print(f"wrote {a.config} ({a.format}) to {a.out}")


if __name__ == "__main__":
    main()
