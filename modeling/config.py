"""Llama-family target configuration, read from GGUF metadata or an HF ``config.json``."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (HF ``LlamaConfig`` naming).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    head_dim: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "llama"

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_gguf_fields(cls, fields: dict, name: str = "llama") -> "LlamaConfig":
        """Build from a dict of GGUF metadata (``llama.*`` keys). Raises KeyError if one is missing."""
        a = fields["general.architecture"]
        heads = int(fields[f"{a}.attention.head_count"])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=int(fields.get(f"{a}.vocab_size") or len(fields["tokenizer.ggml.tokens"])),
            hidden_size=int(fields[f"{a}.embedding_length"]),
            intermediate_size=int(fields[f"{a}.feed_forward_length"]),
            num_hidden_layers=int(fields[f"{a}.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(fields.get(f"{a}.attention.head_count_kv", heads)),
            max_position_embeddings=int(fields[f"{a}.context_length"]),
            rms_norm_eps=float(fields[f"{a}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(fields.get(f"{a}.rope.freq_base", 10000.0)),
            head_dim=int(fields.get(f"{a}.rope.dimension_count", 0)),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            name=name,
        )

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "LlamaConfig":
        """Build from an HF model directory's ``config.json``."""
        path = pathlib.Path(path)
        c = json.loads((path / "config.json").read_text())
        eos = c.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            rms_norm_eps=c.get("rms_norm_eps", 1e-5), rope_theta=c.get("rope_theta", 10000.0),
            tie_word_embeddings=c.get("tie_word_embeddings", False), head_dim=c.get("head_dim") or 0,
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, name=path.name,
        )
