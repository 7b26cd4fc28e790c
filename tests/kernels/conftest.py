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

    # tl.dot through numpy's BLAS is not row-invariant on every CPU: OpenBLAS's sgemm on an AMD EPYC
    # gives a row a result that depends on its position in the tile (24 of 16 rows differ after a
    # move), which a GPU's MMA does not. Sum each output element's products over k in one order
    # (the same for every row and every position), so the interpreter keeps the property under test.
    # It also means that here a BLOCK_M chosen from the row count cannot change a row's bits (a BLOCK_K
    # or split-K chosen so still does): that case is guarded by the GPU tier only.
    _orig_dot = _interp.InterpreterBuilder.create_dot

    def _row_invariant_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # (fp8 operands: as Triton does)
            return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        x, y = a.data.astype(acc, copy=False), b.data.astype(acc, copy=False)
        prod = x[..., :, :, None] * y[..., None, :, :]  # [..., M, K, N]
        return _interp.TensorHandle(prod.sum(axis=-2, dtype=acc) + d.data, d.dtype.scalar)

    _interp.InterpreterBuilder.create_dot = _row_invariant_dot
