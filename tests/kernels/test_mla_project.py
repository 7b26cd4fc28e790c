"""specdec_kernels.mla_project (the MLA projection's epilogue in one launch) equals its float64 reference
on fresh random inputs, a row's result is bitwise the same whatever rows share the launch, and
bad shapes are refused; the row-invariant path's stacked gate/up projection (shared experts,
dense MLPs) equals two projections and never reads stale weights."""
import pytest
import torch
from conftest import DTYPES
from torch import nn

from specdec_kernels.mla_project import mla_project, mla_project_reference
from modeling.deepseek_fast import _swiglu_forward, stack_gate_up_
from modeling.layers import SwiGLU

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(T, h, N, R, C, device, dtype, g):
    q = torch.randn(T, h, N + R, generator=g).to(device, dtype)
    q_lat = torch.randn(T, h, C, generator=g).to(device, dtype)
    ckv = (torch.randn(T, C + R, generator=g) * 3).to(device, dtype)
    w = torch.randn(C, generator=g).to(device, dtype)
    ang = torch.rand(T, R // 2, generator=g) * 40
    cos, sin = (ang.cos() * 1.1).to(device, dtype), (ang.sin() * 1.1).to(device, dtype)
    return q, q_lat, ckv, w, 1e-6, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2, 16, 8, 32), (3, 11, 8, 6, 24), (1, 16, 12, 4, 40)])  # T, h, N, R, C
def test_mla_project_matches_reference_and_is_row_invariant(device, dtype, shape):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, h, N, R, C = shape
    args = _inputs(T, h, N, R, C, device, dtype, g)
    q, lat = mla_project(*args)
    want_q, want_lat = mla_project_reference(*args)
    assert q.shape == (T, h, C + R) and lat.shape == (T, C + R) and q.dtype == lat.dtype == dtype
    for got, want in ((q, want_q), (lat, want_lat)):
        err = (got.double() - want).abs().max().item()
        assert err <= TOL[dtype] * (want.abs().max().item() + 1e-6), err
    assert torch.equal(q[..., :C], args[1])  # q_lat passes through unchanged
    q_pe = args[0][..., N:]
    assert not torch.equal(q[..., C:], q_pe)  # rotated (random angles)
    # a row alone, and among other rows, gives the same bits
    rows = [torch.randn(4, *t.shape[1:], generator=g).to(device, t.dtype) if t.dim() else t for t in args[:3]]
    for i in {0, T - 1}:
        one = [t[i:i + 1] if isinstance(t, torch.Tensor) and t.dim() > 1 else t for t in args]
        q1, l1 = mla_project(*one)
        assert torch.equal(q1[0], q[i]) and torch.equal(l1[0], lat[i])
        mixed = [torch.cat([r, t[i:i + 1]]) for r, t in zip(rows, args[:3])]
        ang = [torch.cat([torch.zeros(4, R // 2, device=device, dtype=dtype), t[i:i + 1]]) for t in args[5:]]
        qm, lm = mla_project(*mixed, args[3], args[4], *ang)
        assert torch.equal(qm[-1], q[i]) and torch.equal(lm[-1], lat[i])


def test_mla_project_strided_q_and_no_rows(device):
    g = torch.Generator().manual_seed(1)
    q, q_lat, ckv, w, eps, cos, sin = _inputs(4, 3, 8, 4, 16, device, torch.float32, g)
    wide = torch.randn(4, 3, 40, generator=g).to(device)
    wide[..., :12] = q  # q as a view with a larger head stride
    got = mla_project(wide[..., :12], q_lat, ckv, w, eps, cos, sin)
    want = mla_project(q, q_lat, ckv, w, eps, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # cos and sin of different row strides (a broadcast table; a wider one), a strided norm weight
    wide_cos = torch.zeros(4, 16, device=device)
    wide_cos[:, :2] = cos
    w2 = torch.zeros(2 * w.numel(), device=device)
    w2[::2] = w
    got = mla_project(wide[..., :12], q_lat, ckv, w2[::2], eps, wide_cos[:, :2], sin[:1].expand(4, -1))
    want = mla_project(q, q_lat, ckv, w, eps, cos, sin[:1].expand(4, -1).contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q0, l0 = mla_project(q[:0], q_lat[:0], ckv[:0], w, eps, cos[:0], sin[:0])
    assert q0.shape == (0, 3, 20) and l0.shape == (0, 20)


def test_mla_project_refuses_bad_shapes_and_dtypes(device):
    g = torch.Generator().manual_seed(2)
    q, q_lat, ckv, w, eps, cos, sin = _inputs(3, 2, 8, 4, 16, device, torch.float32, g)
    bad = {"odd rope width": (q[..., :11], q_lat, ckv[:, :19], w, eps, cos[:, :1], sin[:, :1]),
           "rows differ": (q, q_lat, ckv[:2], w, eps, cos, sin),
           "heads differ": (q[:, :1], q_lat, ckv, w, eps, cos, sin),
           "norm weight": (q, q_lat, ckv, w[:8], eps, cos, sin),
           "rope table": (q, q_lat, ckv, w, eps, cos[:, :1], sin),
           "dtype": (q.double(), q_lat, ckv, w, eps, cos, sin),
           "float64": (q.double(), q_lat.double(), ckv.double(), w, eps, cos, sin),
           "int": (q.int(), q_lat.int(), ckv.int(), w, eps, cos, sin),
           "table dtypes": (q, q_lat, ckv, w, eps, cos, sin.half()),
           "int table": (q, q_lat, ckv, w, eps, cos.int(), sin.int()),
           "2-D q_lat": (q, q_lat[:, 0], ckv, w, eps, cos, sin),
           "no heads": (q[:, :0], q_lat[:, :0], ckv, w, eps, cos, sin),
           "no latent": (q, q_lat[..., :0], ckv[:, 16:], w[:0], eps, cos, sin)}
    for what, args in bad.items():
        with pytest.raises(ValueError, match="mla_project"):
            mla_project(*args)


def _swiglu(device, dtype, hidden=24, inter=40):
    torch.manual_seed(3)
    m = SwiGLU(hidden, inter).to(device, dtype)
    for lin in (m.gate_proj, m.up_proj, m.down_proj):
        lin.weight.data /= 2
    return m


@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_gate_up_equals_two_projections_without_extra_memory(device, dtype):
    import types

    m = _swiglu(device, dtype)
    x = torch.randn(6, 24, device=device, dtype=dtype)
    m.forward = types.MethodType(_swiglu_forward, m)
    m._w13 = None
    two = m(x)  # not stacked: two projections, then specdec_kernels.swiglu
    want = SwiGLU.forward(m, x)
    assert stack_gate_up_(m)
    assert m.gate_proj.weight.data_ptr() == m._w13.data_ptr() and m._w13.shape == (80, 24)
    assert m.up_proj.weight.data_ptr() == m._w13[40:].data_ptr()
    one = m(x)
    tol = TOL[dtype] * 10 * want.abs().max().item()
    assert (one - want).abs().max().item() <= tol and (two - want).abs().max().item() <= tol
    # weights replaced after stacking: restacked from the new tensors, never the stale ones
    m.up_proj.weight.data = torch.zeros_like(m.up_proj.weight)
    assert torch.equal(m(x), torch.zeros_like(want))
    assert m.up_proj.weight.data_ptr() == m._w13[40:].data_ptr()
    # no longer two plain Linears: projects twice, as before
    m.gate_proj = nn.Sequential(m.gate_proj)
    assert not stack_gate_up_(m)
    assert torch.equal(m(x), torch.zeros_like(want))
