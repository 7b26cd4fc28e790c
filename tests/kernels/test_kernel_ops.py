"""Each row-invariant kernel equals its float64 reference on fresh random inputs, and a row's
result is bitwise the same whatever other rows share the launch."""
import pytest
import torch
from conftest import DTYPES

from specdec_kernels.matmul import linear, linear_reference
from specdec_kernels.rope import inv_freq, rope_qkv, rope_qkv_reference
from specdec_kernels.swiglu import swiglu, swiglu_reference
from specdec_kernels.tree_attention import tree_attention, tree_attention_reference

TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def close(got, want, dtype):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= TOL[dtype] * scale, f"max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference_and_is_row_invariant(device, dtype):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for M, N, K in [(1, 96, 80), (37, 130, 64), (70, 64, 200)]:
        x = torch.randn(M, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
        r = torch.randn(M, N, generator=g).to(device, dtype)
        out = linear(x, w)
        close(out, linear_reference(x, w), dtype)
        close(linear(x, w, r), linear_reference(x, w, r), dtype)
        tiled = linear(x, w, tiles=(16, 32, 64, 4, 2))  # another fixed tiling: still row-invariant
        close(tiled, linear_reference(x, w), dtype)
        assert torch.equal(linear(x[-1:], w, tiles=(16, 32, 64, 4, 2))[0], tiled[-1])
        for i in {0, M // 2, M - 1}:  # a row alone, and at another offset among other rows
            assert torch.equal(linear(x[i:i + 1], w), out[i:i + 1])
            shifted = linear(torch.cat([x[i:i + 1].flip(0), torch.randn(5, K, generator=g).to(device, dtype),
                                        x[i:i + 1]]), w)
            assert torch.equal(shifted[-1], out[i]) and torch.equal(shifted[0], out[i])
    fp32_logits = linear(x, w, out_dtype=torch.float32)
    assert fp32_logits.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_matches_reference_and_writes_the_pool(device, dtype):
    h, g, d, R = 9, 3, 64, 7
    qkv = torch.randn(R, (h + 2 * g) * d).to(device, dtype)
    pos = torch.randint(0, 5000, (R,)).to(device)
    slots = torch.randperm(40)[:R].to(device)
    kp, vp = torch.zeros(40, g, d, device=device, dtype=dtype), torch.zeros(40, g, d, device=device, dtype=dtype)
    freqs = inv_freq(d, 10000.0, device)
    q = rope_qkv(qkv, pos, freqs, slots, kp, vp, h, g)
    wq, wk, wv = rope_qkv_reference(qkv, pos, freqs, slots, kp, vp, h, g)
    close(q, wq, dtype), close(kp[slots], wk, dtype), close(vp[slots], wv, dtype)
    untouched = torch.ones(40, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert kp[untouched].abs().sum() == 0 and vp[untouched].abs().sum() == 0
    assert torch.equal(rope_qkv(qkv[3:4], pos[3:4], freqs, slots[3:4], kp, vp, h, g)[0], q[3])
    qn, kn = torch.randn(d).to(device, dtype), torch.randn(d).to(device, dtype)  # per-head norms first
    q = rope_qkv(qkv, pos, freqs, slots, kp, vp, h, g, qn, kn, 1e-6)
    wq, wk, wv = rope_qkv_reference(qkv, pos, freqs, slots, kp, vp, h, g, qn, kn, 1e-6)
    close(q, wq, dtype), close(kp[slots], wk, dtype), close(vp[slots], wv, dtype)
    k_only = torch.zeros_like(kp)  # no query heads (context rows of the drafter)
    assert rope_qkv(qkv[:, h * d:], pos, freqs, slots, k_only, vp, 0, g, qn, kn, 1e-6).numel() == 0
    close(k_only[slots], wk, dtype)  # same values as the q+k+v launch (not bitwise: another tiling)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_reference(device, dtype):
    gu = torch.randn(5, 2 * 1100).to(device, dtype) * 3
    out = swiglu(gu)
    close(out, swiglu_reference(gu), dtype)
    assert torch.equal(swiglu(gu[2:3])[0], out[2])


def random_tree(n: int, g: torch.Generator) -> list[int]:
    """parents [n] with parents[0] = -1 and parents[i] < i."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def ancestors_of(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    anc = torch.zeros(n, max(depth) + 1, dtype=torch.int32)
    for i in range(n):
        v = i
        while v >= 0:
            anc[i, depth[v]] = v
            v = parents[v]
    return torch.tensor(depth), anc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,gkv,d", [(4, 2, 16), (3, 1, 32)])
def test_tree_attention_matches_reference(device, dtype, h, gkv, d):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for L, n in [(0, 1), (5, 1), (70, 9), (130, 23)]:
        rows, base = 400, 17
        kp = torch.randn(rows, gkv, d, generator=g).to(device, dtype)
        vp = torch.randn(rows, gkv, d, generator=g).to(device, dtype)
        q = torch.randn(n, h, d, generator=g).to(device, dtype)
        depth, anc = ancestors_of(random_tree(n, g))
        pos = (L + depth).to(device)
        meta = torch.tensor([base, L, anc.shape[1]], device=device)
        out = tree_attention(q, kp, vp, pos, anc.flatten().to(device), meta)
        close(out, tree_attention_reference(q, kp, vp, pos, anc, meta), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_node_equals_one_row_decode_after_commit(device, dtype):
    """A node at depth δ attends bitwise like a single-row decode at position L+δ once its
    ancestors sit committed at base+L…base+L+δ−1 — the property that makes greedy speculation
    exact."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, gkv, d, L, n, base = 6, 2, 32, 100, 31, 3
    parents = random_tree(n, g)
    depth, anc = ancestors_of(parents)
    kp = torch.randn(600, gkv, d, generator=g).to(device, dtype)
    vp = torch.randn(600, gkv, d, generator=g).to(device, dtype)
    q = torch.randn(n, h, d, generator=g).to(device, dtype)
    tree_out = tree_attention(q, kp, vp, (L + depth).to(device), anc.flatten().to(device),
                              torch.tensor([base, L, anc.shape[1]], device=device))
    for i in range(n):
        dep = int(depth[i])
        path = anc[i, :dep + 1].tolist()
        k2, v2 = kp.clone(), vp.clone()  # commit the path, then decode node i alone
        k2[base + L:base + L + dep + 1] = kp[[base + L + j for j in path]]
        v2[base + L:base + L + dep + 1] = vp[[base + L + j for j in path]]
        one = tree_attention(q[i:i + 1], k2, v2, torch.tensor([L + dep], device=device),
                             torch.zeros(1, dtype=torch.int32, device=device),
                             torch.tensor([base, L + dep, 1], device=device))
        assert torch.equal(one[0], tree_out[i]), f"node {i} depth {dep}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_row_meta_batches_requests(device, dtype):
    """Rows of three requests (own base, prefix L and tree) in one launch with per-row (base, L)
    equal each request's rows launched alone bitwise, and the float64 reference; ancestors are
    padded to the batch's widest tree (W in meta)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, gkv, d = 4, 2, 16
    kp = torch.randn(900, gkv, d, generator=g).to(device, dtype)
    vp = torch.randn(900, gkv, d, generator=g).to(device, dtype)
    reqs = [(300, 0, 1), (17, 140, 12), (520, 5, 6)]  # (base, L, rows): AR root at L=0, a tree, a tree
    qs, pos, ancs, rm, alone = [], [], [], [], []
    for base, L, n in reqs:
        depth, anc = ancestors_of(random_tree(n, g))
        q = torch.randn(n, h, d, generator=g).to(device, dtype)
        qs.append(q), pos.append(L + depth), ancs.append(anc)
        rm += [[base, L]] * n
        alone.append(tree_attention(q, kp, vp, (L + depth).to(device), anc.flatten().to(device),
                                    torch.tensor([base, L, anc.shape[1]], device=device)))
    W = max(a.shape[1] for a in ancs)
    anc = torch.cat([torch.nn.functional.pad(a, (0, W - a.shape[1])) for a in ancs])
    q, pos = torch.cat(qs), torch.cat(pos).to(device)
    meta = torch.tensor([0, 0, W], device=device)  # base/L of meta are ignored with row_meta
    row_meta = torch.tensor(rm, dtype=torch.int64, device=device)
    out = tree_attention(q, kp, vp, pos, anc.flatten().to(device), meta, row_meta)
    assert torch.equal(out, torch.cat(alone))
    close(out, tree_attention_reference(q, kp, vp, pos, anc, meta, row_meta), dtype)
    one = tree_attention(q[5:6], kp, vp, pos[5:6], anc[5].to(device), torch.tensor([0, 0, W], device=device),
                         row_meta[5:6].contiguous())  # a row alone with row_meta
    assert torch.equal(one[0], out[5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_rows", [16, 128])
def test_paged_tree_attention_equals_contiguous(device, dtype, page_rows):
    """A paged pool (issue 14): three requests' rows scattered over shuffled, non-contiguous
    pages (page tables packed in one flat tensor, each row's base = its table's offset) give
    bitwise the contiguous launch's output over the same K/V, and match the float64 reference;
    a padded row pointed at a table entry of page 0 reads only that scratch page."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, gkv, d = 4, 2, 16
    reqs = [(300, 0, 1), (17, 140, 12), (520, 5, 6)]  # (contiguous base, L, rows)
    kc = torch.randn(900, gkv, d, generator=g)
    vc = torch.randn(900, gkv, d, generator=g)
    npages = [-(-(L + n) // page_rows) for _, L, n in reqs]
    order = (1 + torch.randperm(sum(npages) + 3, generator=g)).tolist()  # page 0 = scratch
    kpg = torch.randn((sum(npages) + 4) * page_rows, gkv, d, generator=g)
    vpg = torch.randn(kpg.shape, generator=g)
    tables, rm_c, rm_p, qs, pos, ancs = [], [], [], [], [], []
    for (base, L, n), np_ in zip(reqs, npages):
        table, order = order[:np_], order[np_:]
        for s in range(L + n):  # the same K/V at the request's paged rows
            r = table[s // page_rows] * page_rows + s % page_rows
            kpg[r], vpg[r] = kc[base + s], vc[base + s]
        depth, anc = ancestors_of(random_tree(n, g))
        rm_p += [[len(tables), L]] * n
        rm_c += [[base, L]] * n
        tables += table
        qs.append(torch.randn(n, h, d, generator=g)), pos.append(L + depth), ancs.append(anc)
    tables.append(0)  # the padded row's table: the scratch page
    W = max(a.shape[1] for a in ancs)
    anc = torch.cat([torch.nn.functional.pad(a, (0, W - a.shape[1])) for a in ancs] + [torch.zeros(1, W, dtype=torch.int32)])
    q = torch.cat(qs + [torch.randn(1, h, d, generator=g)]).to(device, dtype)
    pos = torch.cat(pos + [torch.zeros(1, dtype=torch.int64)]).to(device)
    meta = torch.tensor([0, 0, W], device=device)
    rm_c.append([0, 0])
    rm_p.append([len(tables) - 1, 0])
    contiguous = tree_attention(q, kc.to(device, dtype), vc.to(device, dtype), pos, anc.flatten().to(device), meta,
                                torch.tensor(rm_c, device=device))
    pages = torch.tensor(tables, device=device)
    kpg, vpg = kpg.to(device, dtype), vpg.to(device, dtype)
    paged = tree_attention(q, kpg, vpg, pos, anc.flatten().to(device), meta, torch.tensor(rm_p, device=device),
                           pages, page_rows)
    assert torch.equal(paged[:-1], contiguous[:-1])
    want = tree_attention_reference(q, kpg, vpg, pos, anc, meta, torch.tensor(rm_p), pages.cpu(), page_rows)
    close(paged, want, dtype)
    assert torch.equal(want[-1].view(h, d), vpg[0].double().repeat_interleave(h // gkv, 0))  # scratch row 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_tile_height_and_width_do_not_change_bits(device, dtype):
    """BM and BN only group output elements; with the same BK each element is the same K loop — so a
    weight may take any BM × BN (e.g. 16 × 16) without
    another arithmetic. (On the GPU: an MMA or FMA element does not depend on the tile's M or N.)"""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(8, 384, generator=g).to(device, dtype)
    w = (torch.randn(96, 384, generator=g) / 384 ** 0.5).to(device, dtype)
    want = linear(x, w, tiles=(64, 64, 128, 4, 3))
    for t in [(16, 16, 128, 4, 3), (32, 64, 128, 4, 2), (16, 32, 128, 8, 3)]:
        assert torch.equal(linear(x, w, tiles=t), want), t


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_linear_matches_reference_and_is_row_invariant(device, dtype):
    """A split-K tiling (S runs of whole K blocks, partials added in a fixed order) is another fixed
    arithmetic per weight: close to the float64 reference, a row's bits independent of the other rows
    and of M, with and without a residual; S = 1 is the plain kernel; a K not divisible by S·BK
    (short last run) and an S larger than K's blocks (fewer runs) work."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for M, N, K, split in [(1, 96, 448, 3), (37, 130, 320, 2), (9, 64, 200, 7)]:
        t = (16, 32, 64, 4, 2, split)
        x = torch.randn(M, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
        r = torch.randn(M, N, generator=g).to(device, dtype)
        out, with_res = linear(x, w, tiles=t), linear(x, w, r, tiles=t)
        close(out, linear_reference(x, w), dtype)
        close(with_res, linear_reference(x, w, r), dtype)
        assert torch.equal(linear(x, w, tiles=t[:5] + (1,)), linear(x, w, tiles=t[:5]))
        for i in {0, M // 2, M - 1}:
            assert torch.equal(linear(x[i:i + 1], w, tiles=t), out[i:i + 1])
            assert torch.equal(linear(x[i:i + 1], w, r[i:i + 1], tiles=t), with_res[i:i + 1])
            more = torch.cat([torch.randn(40, K, generator=g).to(device, dtype), x[i:i + 1]])
            assert torch.equal(linear(more, w, tiles=t)[-1], out[i])
        assert linear(x, w, out_dtype=torch.float32, tiles=t).dtype == torch.float32


def test_linear_empty_k_and_a_bad_split_count(device):
    """K = 0 gives zeros (plus the residual) with or without a split; a split count below 1 or not an
    int is refused naming tiles[5] (a negative one used to return uninitialised memory)."""
    x, w = torch.randn(3, 0, device=device), torch.randn(5, 0, device=device)
    r = torch.randn(3, 5, device=device)
    for t in (None, (16, 32, 64, 4, 2, 3)):
        assert torch.equal(linear(x, w, tiles=t), torch.zeros(3, 5, device=device))
        assert torch.equal(linear(x, w, r, tiles=t), r)
    x, w = torch.randn(3, 64, device=device), torch.randn(5, 64, device=device)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match=r"tiles\[5\]"):
            linear(x, w, tiles=(16, 32, 64, 4, 2, bad))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_linear_matches_reference_and_is_row_invariant(device, dtype):
    from specdec_kernels.matmul import head_linear

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for M, h, N, K in [(1, 3, 40, 24), (19, 2, 64, 128), (33, 5, 17, 200)]:
        wide = torch.randn(M, h, K + 7, generator=g).to(device, dtype)
        x = wide[..., 3:K + 3]  # a strided view, as q's nope part is
        w = (torch.randn(h, N, K, generator=g) / K ** 0.5).to(device, dtype)
        out = head_linear(x, w)
        want = torch.einsum("mhk,hnk->mhn", x.double(), w.double())
        assert out.shape == (M, h, N) and out.dtype == dtype
        close(out, want, dtype)
        for i in {0, M // 2, M - 1}:  # a row alone, and among other rows, has the same bits
            assert torch.equal(head_linear(x[i:i + 1], w)[0], out[i])
            mixed = torch.cat([torch.randn(4, h, K, generator=g).to(device, dtype), x[i:i + 1]])
            assert torch.equal(head_linear(mixed, w)[-1], out[i])
    assert head_linear(x[:0], w).shape == (0, h, N)
    for bad in ((x, w[:1]), (x[..., :-1], w), (x.double(), w.double()), (x[0], w)):
        with pytest.raises(ValueError, match="head_linear"):
            head_linear(*bad)


def test_wide_row_offsets_give_the_same_bits(device, monkeypatch):
    """Tensors of ≥ 2^31 elements take int64 row offsets (WIDE); the values are those of the int32 path."""
    import specdec_kernels.matmul as mm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(21, 3, 40, generator=g).to(device)
    w = torch.randn(3, 24, 40, generator=g).to(device)
    r = torch.randn(21, 24, generator=g).to(device)
    narrow = (mm.head_linear(x, w), mm.linear(x[:, 0], w[0], r), mm.linear(x[:, 0], w[0], tiles=(16, 32, 16, 4, 2, 2)))
    monkeypatch.setattr(mm, "_wide", lambda *a: True)
    wide = (mm.head_linear(x, w), mm.linear(x[:, 0], w[0], r), mm.linear(x[:, 0], w[0], tiles=(16, 32, 16, 4, 2, 2)))
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide))
    with pytest.raises(ValueError, match="head_linear: tiles"):
        mm.head_linear(x, w, tiles=(16, 16))
    with pytest.raises(ValueError, match="head_linear: tiles"):
        mm.head_linear(x, w, tiles=(16, 32, 16, 4, 2, 3))
