"""Loading target weights: GGUF (dequantised with the ``gguf`` package) or HF safetensors.

Both produce a state dict with HF Llama names (``model.layers.{i}.self_attn.q_proj.weight`` …).
"""
from __future__ import annotations

import pathlib

import numpy as np
import torch

from modeling.config import LlamaConfig
from modeling.model_files import default_gguf_path, gguf_metadata  # noqa: F401  (re-exported)

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs → HF half-split rotary layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    return {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
            "model.norm.weight": "output_norm.weight"}.get(hf_name, hf_name)


def load_gguf(path: str | pathlib.Path, only: set[str] | None = None) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Dequantise a llama GGUF to float32 tensors with HF names (``only``: just these names).

    Returns (config, state_dict). Weights are [out_features, in_features] float32.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = pathlib.Path(path)
    reader = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    cfg = LlamaConfig.from_gguf_fields(fields, name=path.stem)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if only is not None and t.name not in {_gguf_name(n) for n in only}:
            continue
        # GGUF shapes list the fastest dimension first; dequantize returns numpy row-major.
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, kind = int(parts[1]), parts[2]
            if kind == "attn_q":
                arr = _unpermute_rope(arr, cfg.num_attention_heads)
            elif kind == "attn_k":
                arr = _unpermute_rope(arr, cfg.num_key_value_heads)
            name = f"model.layers.{layer}.{_GGUF_TO_HF[kind]}.weight"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            continue
        state[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    if "lm_head.weight" not in state:
        object.__setattr__(cfg, "tie_word_embeddings", True)
    return cfg, state


def load_hf_dir(path: str | pathlib.Path, only: set[str] | None = None) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Load an HF Llama directory (config.json + *.safetensors) as float32 tensors
    (``only``: just these names)."""
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    cfg = LlamaConfig.from_hf_dir(path)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(f)).items() if only is None or k in only})
    if not state:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return cfg, state


def load_target(path: str | pathlib.Path | None = None, only: set[str] | None = None
                ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Load a target from a GGUF file or an HF directory; None = the embedded default."""
    path = pathlib.Path(path) if path else default_gguf_path()
    return load_hf_dir(path, only) if path.is_dir() else load_gguf(path, only)


def load_embedding_and_head(path: str | pathlib.Path | None = None) -> tuple[LlamaConfig, torch.Tensor, torch.Tensor]:
    """Only the target's token embedding and LM head [V, H] float32 (what a drafter borrows)."""
    cfg, state = load_target(path, {"model.embed_tokens.weight", "lm_head.weight"})
    embed = state["model.embed_tokens.weight"]
    return cfg, embed, state.get("lm_head.weight", embed)
