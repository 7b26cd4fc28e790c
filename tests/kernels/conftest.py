"""Kernel tests run on the GPU when there is one, else through Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before any kernel module is imported) at small shapes."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on the GPU (the case that matters); fp32 in the interpreter (numpy has no bf16 matmul)
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float32]


@pytest.fixture
def device():
    return DEVICE

if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton 3.6's interpreter converts a 1-element array with int(), which numpy >= 2.4 refuses
    # ("only 0-dimensional arrays can be converted"): index loop bounds through .item() instead.
    from triton.runtime import interpreter as _interp

    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor
