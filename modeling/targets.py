"""Target model by checkpoint: an HF directory whose config.json names a DeepSeek-V3 family
``model_type`` (deepseek_v3, kimi_k2) loads ``DeepseekModel``; anything else (GGUF file, Llama
HF directory, None = the embedded default) loads ``LlamaModel``. Both expose the same forward,
``logits``, ``new_cache`` and ``cfg`` interface to the target engine."""
from __future__ import annotations

import json
import pathlib

import torch


def model_type(path: str | pathlib.Path | None) -> str:
    """config.json's model_type for an HF directory, "gguf" for a file or None."""
    if not path or not pathlib.Path(path).is_dir():
        return "gguf"
    return json.loads((pathlib.Path(path) / "config.json").read_text()).get("model_type", "llama")


def load_target_model(path: str | pathlib.Path | None, device, dtype: torch.dtype, keep_fp8: bool = False):
    """The target model on ``device`` in ``dtype`` (eval, no grad). keep_fp8: a DeepSeek-family
    FP8 checkpoint's linear weights stay FP8 in memory (``modeling.deepseek_weights.FP8Linear``)."""
    from modeling.deepseek import MODEL_TYPES

    if model_type(path) in MODEL_TYPES:
        from modeling.deepseek_weights import load_deepseek

        return load_deepseek(path, device, dtype, keep_fp8=keep_fp8)
    from modeling.llama import LlamaModel
    from modeling.weights import load_target

    cfg, state = load_target(path or None)
    return LlamaModel.from_state_dict(cfg, state, device, dtype)
