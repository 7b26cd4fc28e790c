"""Defaults tying the embedded target to its drafter: checkpoint location and tapped layers."""
from __future__ import annotations

import json
import pathlib

from modeling.config import LlamaConfig
from modeling.dflash import DFlashConfig, default_taps

#: The shipped DFlash drafter for SmolLM2-135M-Instruct (published DFlash layout).
DEFAULT_DRAFTER_DIR = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "dflash-smollm2-135m"
#: An existing but unused row of SmolLM2's embedding (``<empty_output>``), the mask token.
DEFAULT_MASK_TOKEN_ID = 16


def drafter_config(target: LlamaConfig, directory: str | pathlib.Path | None = None, fresh: bool = False,
                   num_layers: int = 3, num_taps: int = 3, block_size: int = 16) -> DFlashConfig:
    """Config of the drafter at ``directory`` (default: the shipped one if present), else (or
    with ``fresh``) the config of a new drafter sized from the target."""
    directory = pathlib.Path(directory) if directory else DEFAULT_DRAFTER_DIR
    if not fresh and (directory / "config.json").exists():
        return DFlashConfig.from_json(json.loads((directory / "config.json").read_text()))
    return DFlashConfig(
        hidden_size=target.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim, intermediate_size=target.intermediate_size, vocab_size=target.vocab_size,
        target_layer_ids=tuple(default_taps(target.num_hidden_layers, num_taps)),
        mask_token_id=DEFAULT_MASK_TOKEN_ID, block_size=block_size, rms_norm_eps=target.rms_norm_eps)
