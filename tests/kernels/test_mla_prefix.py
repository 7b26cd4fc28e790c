"""The Gluon prefix launch (specdec_kernels/mla_prefix.py, Hopper) folds the committed prefix into the
same fp32 partials as the Triton launch, bit for bit, so the Triton tree-block launch continues
either, and a tree node still equals its one-row decode after commit; its output matches the
float64 reference. Fresh random inputs at Kimi-K2's per-rank shapes under TP8 (h = 8, latent
512 + 64, bf16). GPU-only (compute capability 9): the interpreter cannot run Gluon; where the
kernel does not apply, ``prefix="gluon"`` is refused with the reason."""
import pytest
import torch
from test_mla_attention import batch, close, paged

from specdec_kernels.mla_attention import mla_attention, mla_attention_reference

mla_prefix = pytest.importorskip("specdec_kernels.mla_prefix", reason="a Triton without Gluon's Hopper API")

H, C, R, SCALE = 8, 512, 64, 0.1309
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
gpu = pytest.mark.skipif(not HOPPER, reason="needs a compute-capability-9 GPU (Gluon wgmma/TMA kernel)")
# L crossing blocks (64) and chunks (256 / 1024 / 2048): below one block, on an edge, across several chunks
SPECS = [(0, 1), (63, 5), (64, 9), (1000, 32), (2100, 17), (3000, 64)]


@pytest.fixture(params=[True, False], ids=["warp-specialised", "one-program"])
def gluon_kernel(request, monkeypatch):
    """Each test below runs with both Gluon kernels (specdec_kernels.mla_prefix.WARP_SPECIALIZE)."""
    monkeypatch.setattr(mla_prefix, "WARP_SPECIALIZE", request.param)


@gpu
@pytest.mark.parametrize("chunk", [2048, 1024, 256])
def test_gluon_prefix_partials_equal_triton(chunk, gluon_kernel):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, kv, pos, anc, seqs = batch(SPECS, H, C, R, torch.bfloat16, "cuda", g, rows=9000, back=4)
    got = mla_attention(q, kv, pos, anc, seqs, SCALE, C, chunk=chunk, prefix="gluon", partials=True)
    want = mla_attention(q, kv, pos, anc, seqs, SCALE, C, chunk=chunk, prefix="triton", partials=True)
    for r0, n, _, _ in seqs:  # the slots both launches write: chunks up to each tile's deepest row
        last = int(pos[r0:r0 + n].max()) // chunk + 1
        for a, b, name in zip(got, want, ("m", "l", "acc")):
            assert torch.equal(a[r0:r0 + n, :last], b[r0:r0 + n, :last]), f"{name} of rows {r0}..{r0 + n - 1}"


@gpu
def test_gluon_prefix_output_and_row_invariance(gluon_kernel):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, kv, pos, anc, seqs = batch([(45, 6), (4090, 24)], H, C, R, torch.bfloat16, "cuda", g, rows=4300, back=3)
    out = mla_attention(q, kv, pos, anc, seqs, SCALE, C, prefix="gluon")
    close(out, mla_attention_reference(q, kv, pos, anc, seqs, SCALE, C), torch.bfloat16)
    assert torch.equal(out, mla_attention(q, kv, pos, anc, seqs, SCALE, C, prefix="triton"))
    r0, n, base, L = seqs[1]  # L 4090: deep nodes' keys cross the 4096 block/chunk edge after commit
    for i in range(r0, r0 + n):
        dep = int(pos[i]) - L
        kv2 = kv.clone()
        kv2[base + L:base + L + dep + 1] = kv[[base + L + j for j in anc[i, :dep + 1].tolist()]]
        one = mla_attention(q[i:i + 1], kv2, pos[i:i + 1], torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
                            [(0, 1, base, L + dep)], SCALE, C, prefix="gluon")
        assert torch.equal(one[0], out[i]), f"row {i} depth {dep}"


@gpu
@pytest.mark.parametrize("page_rows", [64, 128])
def test_gluon_prefix_over_page_tables_equals_the_contiguous_pool(page_rows, gluon_kernel):
    """A paged latent pool (each request's rows scattered over pages, unused rows NaN): the Gluon launch
    looks each key block's page up and gives the contiguous layout's partials and output bit for bit —
    and the Triton launch's over the same pages."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, kv, pos, anc, seqs = batch(SPECS, H, C, R, torch.bfloat16, "cuda", g, rows=9000, back=4)
    pool, pages, pseqs = paged(kv, seqs, page_rows, g)
    for part in (True, False):
        want = mla_attention(q, kv, pos, anc, seqs, SCALE, C, prefix="gluon", partials=part)
        got = mla_attention(q, pool, pos, anc, pseqs, SCALE, C, prefix="gluon", partials=part, pages=pages,
                            page_rows=page_rows)
        tri = mla_attention(q, pool, pos, anc, pseqs, SCALE, C, prefix="triton", partials=part, pages=pages,
                            page_rows=page_rows)
        if part:
            for r0, n, _, _ in seqs:
                last = int(pos[r0:r0 + n].max()) // 2048 + 1
                for a, b, c in zip(got, want, tri):
                    assert torch.equal(a[r0:r0 + n, :last], b[r0:r0 + n, :last])
                    assert torch.equal(a[r0:r0 + n, :last], c[r0:r0 + n, :last])
        else:
            assert torch.equal(got, want) and torch.equal(got, tri)
            assert not got.isnan().any()


def test_gluon_prefix_refused_where_it_does_not_apply(device):
    """CPU, fp32, or a shape the kernel does not take: a ValueError naming what it needs."""
    q = torch.zeros(2, 4, 80, device=device)
    args = (torch.zeros(8, 80, device=device), torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros(2, 1, dtype=torch.int32, device=device), [(0, 2, 0, 0)], 0.1, 64)
    with pytest.raises(ValueError, match="prefix 'gluon' needs bf16"):
        mla_attention(q, *args, prefix="gluon")
    with pytest.raises(ValueError, match="prefix 'cutlass'"):
        mla_attention(q, *args, prefix="cutlass")
    out = mla_attention(q, *args, prefix="auto")  # falls back to the Triton launch
    assert torch.equal(out, mla_attention(q, *args, prefix="triton"))


def test_gluon_prefix_refusal_names_the_reason_and_a_bad_prefix_comes_first(device):
    """At the kernel's own shapes (bf16, h 8, C 512, R 64) off a Hopper GPU the refusal names
    what is missing (the device), not a list of requirements all met; a bad ``prefix`` value is
    named whatever else is wrong with the call (here an empty batch and a bad vsplit)."""
    if HOPPER:
        pytest.skip("the Gluon launch applies here")
    q = torch.zeros(2, H, C + R, device=device, dtype=torch.bfloat16)
    args = (torch.zeros(8, C + R, device=device, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64,
            device=device), torch.zeros(2, 1, dtype=torch.int32, device=device), [(0, 2, 0, 0)], SCALE, C)
    with pytest.raises(ValueError, match=f"prefix 'gluon' needs bf16.*here q is on {q.device}"):
        mla_attention(q, *args, prefix="gluon")
    assert mla_prefix.unsupported(q, args[0], C, 8, 64, 1)
    with pytest.raises(ValueError, match="prefix 'cutlass'"):
        mla_attention(q, *args, prefix="cutlass", vsplit=3)
    with pytest.raises(ValueError, match="prefix 'cutlass'"):
        mla_attention(q[:0], args[0], args[1][:0], args[2][:0], [], SCALE, C, prefix="cutlass")
