"""The same model code loads an HF Llama directory (config.json + safetensors)."""
import json

import torch
from safetensors.torch import save_file

from modeling.llama import LlamaModel, causal_mask
from modeling.weights import load_target


def test_hf_directory_equals_gguf(tmp_path, target_bundle, target_model):
    cfg, state = target_bundle
    (tmp_path / "config.json").write_text(json.dumps(dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1)))
    half = len(state) // 2
    names = sorted(state)
    save_file({k: state[k].contiguous() for k in names[:half]}, str(tmp_path / "model-1.safetensors"))
    save_file({k: state[k].contiguous() for k in names[half:]}, str(tmp_path / "model-2.safetensors"))
    cfg2, state2 = load_target(tmp_path)
    assert cfg2.head_dim == cfg.head_dim and cfg2.eos_token_ids == (2,)
    m2 = LlamaModel.from_state_dict(cfg2, state2)
    x = torch.tensor([1, 504, 3459, 314, 260])
    outs = []
    for m in (target_model, m2):
        h, _ = m(x, torch.arange(5), m.new_cache(5), causal_mask(0, 5))
        outs.append(m.logits(h))
    torch.testing.assert_close(outs[0], outs[1])
