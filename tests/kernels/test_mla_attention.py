"""The absorbed MLA tree-attention kernel equals its float64 reference on fresh random inputs,
and a row's output is bitwise independent of the launch around it: a tree node equals a one-row
decode after its path is committed, and a request's rows are the same whatever else (other
requests, a larger tree around the same nodes) shares the launch (interpreter on CPU at small
shapes; bf16 and fp32 on a GPU)."""
import pytest
import torch
from conftest import DTYPES

from specdec_kernels.mla_attention import mla_attention, mla_attention_reference
from modeling.tree import tree_ancestors

TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 3e-3}
SMALL = dict(bn=16, chunk=32)  # several blocks and chunks at interpreter-sized prefixes
V1 = dict(SMALL, vsplit=1)     # the whole V accumulator in one program


def random_tree(n, g, back=None):
    """parents: uniform over all earlier nodes (bushy), or one of the `back` previous (deep)."""
    if back:
        parents = [-1] + [max(0, i - 1 - int(torch.randint(0, back, (1,), generator=g))) for i in range(1, n)]
    else:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    depth, anc = tree_ancestors(parents)
    return torch.from_numpy(depth), torch.from_numpy(anc)


def batch(specs, h, C, R, dtype, device, g, rows=400, back=None):
    """Requests (L, n): a random pool, random trees and queries, rows laid out request by
    request. Returns q, kv, positions, ancestors [T, W], seqs."""
    kv = torch.randn(rows, C + R, generator=g).to(device, dtype)
    q, pos, ancs, seqs, r0, base = [], [], [], [], 0, 3
    for L, n in specs:
        depth, anc = random_tree(n, g, back)
        q.append(torch.randn(n, h, C + R, generator=g))
        pos.append(L + depth)
        ancs.append(anc)
        seqs.append((r0, n, base, L))
        r0, base = r0 + n, base + L + n + 5
    W = max(a.shape[1] for a in ancs)
    anc = torch.cat([torch.nn.functional.pad(a, (0, W - a.shape[1])) for a in ancs]).to(device)
    return torch.cat(q).to(device, dtype), kv, torch.cat(pos).to(device), anc, seqs


def close(got, want, dtype):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= TOL[dtype] * scale, f"max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,C,R,kw,back", [(4, 64, 16, V1, None), (2, 32, 16, dict(bn=16, chunk=64, block_r=8, vsplit=1), 3),
                                           (8, 512, 64, dict(bn=32, chunk=64), 4),
                                           (4, 64, 16, dict(bn=32, chunk=32, tma=True, vsplit=2, tail_stages=2), 2),
                                           (1, 32, 16, SMALL, None)])  # one head per rank: default block_r (32)
def test_mla_attention_matches_reference(device, dtype, h, C, R, kw, back):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    specs = [(0, 1), (5, 1), (40, 9), (70, 23)] if C < 512 else [(0, 1), (45, 6)]
    q, kv, pos, anc, seqs = batch(specs, h, C, R, dtype, device, g, back=back)
    scale = 0.1352  # DeepSeek-V3's, not 1/sqrt(C + R)
    out = mla_attention(q, kv, pos, anc, seqs, scale, C, **kw)
    assert out.shape == (q.shape[0], h, C) and out.dtype == dtype
    close(out, mla_attention_reference(q, kv, pos, anc, seqs, scale, C), dtype)
    # a larger chunk grid than needed changes nothing
    assert torch.equal(mla_attention(q, kv, pos, anc, seqs, scale, C, max_positions=int(pos.max()) + 200, **kw), out)
    if kw.get("tma"):  # TMA loads (or pipelined gathers) bring the same bytes into the same dots: not a bit changes
        assert torch.equal(mla_attention(q, kv, pos, anc, seqs, scale, C, **dict(kw, tma=False, tail_stages=1)), out)
    # the tree launch per row (each row its own leader) or per tile (leaders serving several rows), in
    # dots of the tile's rows or of 16 (another MMA instruction on the GPU): each row folds the same
    # keys through the same step, so the same bits
    for rows in (False, True):
        for tail_m in (None, 16):
            got = mla_attention(q, kv, pos, anc, seqs, scale, C, **dict(kw, tail_rows=rows, tail_m=tail_m))
            assert torch.equal(got, out), f"tail_rows={rows} tail_m={tail_m}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("back,kw", [(None, V1), (2, V1), (2, dict(SMALL, tma=True, vsplit=2))])
def test_tree_node_equals_one_row_decode_after_commit(device, dtype, back, kw):
    """Node i at depth δ, in a batch with another request, bitwise equals a launch holding only
    the one-row decode at L + δ with i's path committed at base + L…: the property that makes
    greedy speculation exact. L = 45 puts the tree across block (16) and chunk (32) edges;
    bushy trees (many leaders per block) and deep ones (rows sharing their ancestors' loads);
    V columns split over two programs (vsplit 2) as well."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, C, R = 4, 64, 16
    q, kv, pos, anc, seqs = batch([(30, 5), (45, 19)], h, C, R, dtype, device, g, back=back)
    out = mla_attention(q, kv, pos, anc, seqs, 0.2, C, **kw)
    r0, n, base, L = seqs[1]
    for i in range(r0, r0 + n):
        dep = int(pos[i]) - L
        path = anc[i, :dep + 1].tolist()
        kv2 = kv.clone()
        kv2[base + L:base + L + dep + 1] = kv[[base + L + j for j in path]]
        args = (kv2, pos[i:i + 1], torch.zeros(1, 1, dtype=torch.int32, device=device), [(0, 1, base, L + dep)], 0.2, C)
        assert torch.equal(mla_attention(q[i:i + 1], *args, **kw)[0], out[i]), f"row {i} depth {dep}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_tree_around_them(device, dtype):
    """The first k nodes of a tree (a valid tree of k rows: parents come first) give bitwise the
    same rows alone as inside the whole tree, and alone as beside other requests; fresh inputs,
    L = 61 so the tree starts inside a block, deep tree so chunks split the ancestors."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, C, R = 4, 64, 16
    q, kv, pos, anc, seqs = batch([(61, 28)], h, C, R, dtype, device, g, back=3)
    full = mla_attention(q, kv, pos, anc, seqs, 0.17, C, **SMALL)
    for k in (1, 9, 20):
        sub = mla_attention(q[:k], kv, pos[:k], anc[:k], [(0, k, seqs[0][2], 61)], 0.17, C, **SMALL)
        assert torch.equal(sub, full[:k]), f"first {k} nodes"
    # the same request after another one in the launch (its rows at another tile offset)
    q2, kv2, pos2, anc2, seqs2 = batch([(20, 3)], h, C, R, dtype, device, g)
    W = max(anc.shape[1], anc2.shape[1])
    pad = lambda a: torch.nn.functional.pad(a, (0, W - a.shape[1]))  # noqa: E731
    base = kv.shape[0]
    both = mla_attention(torch.cat([q2, q]), torch.cat([kv, kv2]), torch.cat([pos2, pos]),
                         torch.cat([pad(anc2), pad(anc)]), [(0, 3, base + seqs2[0][2], 20), (3, 28, seqs[0][2], 61)],
                         0.17, C, **SMALL)
    assert torch.equal(both[3:], full)


def test_rejects_unsupported_shapes(device):
    q = torch.zeros(1, 3, 80, device=device)
    with pytest.raises(ValueError, match="power-of-two"):
        mla_attention(q, torch.zeros(4, 80, device=device), torch.zeros(1, dtype=torch.int64, device=device),
                      torch.zeros(1, 1, dtype=torch.int32, device=device), [(0, 1, 0, 0)], 0.1, 64)
    q = torch.zeros(1, 4, 80, device=device)
    with pytest.raises(ValueError, match="vsplit 3"):
        mla_attention(q, torch.zeros(4, 80, device=device), torch.zeros(1, dtype=torch.int64, device=device),
                      torch.zeros(1, 1, dtype=torch.int32, device=device), [(0, 1, 0, 0)], 0.1, 64, vsplit=3)
    one = (torch.zeros(4, 80, device=device), torch.zeros(1, dtype=torch.int64, device=device),
           torch.zeros(1, 1, dtype=torch.int32, device=device), [(0, 1, 0, 0)], 0.1, 64)
    for bad in (0, 8, 24, 128, 16.0, True):  # tree-launch rows: a power-of-two int in [max(16, h), block_r·h]
        with pytest.raises(ValueError, match="tail_m"):
            mla_attention(q, *one, tail_m=bad)
    for bad in (0, 3, -1, 2.0):
        with pytest.raises(ValueError, match="tail_warps"):
            mla_attention(q, *one, tail_warps=bad)
    with pytest.raises(ValueError, match="block 24"):
        mla_attention(q, torch.zeros(4, 80, device=device), torch.zeros(1, dtype=torch.int64, device=device),
                      torch.zeros(1, 1, dtype=torch.int32, device=device), [(0, 1, 0, 0)], 0.1, 64, bn=24)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vsplit", [1, 2])
def test_combine_program_shape_does_not_change_bits(device, dtype, vsplit):
    """The combine launch folds a row's chunk partials elementwise per (head, column): one program
    per row or per (row, head, a few columns) — the launch picks by the number of rows — gives the
    same bits."""
    from specdec_kernels.mla_attention import _mla_combine_kernel

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, C, R, chunk = 4, 64, 16, 32
    q, kv, pos, anc, seqs = batch([(45, 6), (70, 9)], h, C, R, dtype, device, g, back=2)
    kw = dict(bn=16, chunk=chunk, vsplit=vsplit)
    pm, pl, pacc = mla_attention(q, kv, pos, anc, seqs, 0.2, C, partials=True, **kw)
    outs = []
    for hb, cs, warps in [(h, C // vsplit, 4), (1, 16, 1), (2, 32 // vsplit, 2)]:
        out = torch.empty(q.shape[0], h, C, device=device, dtype=dtype)
        _mla_combine_kernel[(q.shape[0], h // hb, C // cs)](pm, pl, pacc, pos, out, out.stride(0), pm.shape[1], H=h, C=C,
                                                             CHUNK=chunk, VSPLIT=vsplit, HB=hb, CS=cs, num_warps=warps)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert torch.equal(outs[0], mla_attention(q, kv, pos, anc, seqs, 0.2, C, **kw))


def paged(kv, seqs, page_rows, g):
    """The same requests over a paged pool: each request's logical rows (L + tree rows) scattered
    into randomly chosen pages of page_rows rows. Returns (paged kv, pages [n] int32, seqs with each
    base replaced by its table's offset)."""
    need = [-(-(L + n) // page_rows) for _, n, _, L in seqs]
    n_pages = sum(need) + 5
    order = torch.randperm(n_pages, generator=g)
    pool = torch.full((n_pages * page_rows, kv.shape[1]), float("nan"), dtype=kv.dtype, device=kv.device)
    tables, out_seqs, used = [], [], 0
    for (r0, n, base, L), k in zip(seqs, need):
        table = order[used:used + k]
        for r in range(L + n):
            pool[int(table[r // page_rows]) * page_rows + r % page_rows] = kv[base + r]
        out_seqs.append((r0, n, sum(len(t) for t in tables), L))
        tables.append(table)
        used += k
    return pool, torch.cat(tables).to(torch.int32).to(kv.device), out_seqs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [SMALL, dict(bn=16, chunk=64, block_r=8, tail_rows=True)], ids=["tiles", "rows"])
def test_paged_pool_gives_the_contiguous_layouts_bits(device, dtype, kw):
    """Page tables change where a request's latent rows live, not which rows reach which step: the
    output over a paged pool (pages of 32 rows, a request's pages scattered, unused rows NaN) equals
    the contiguous layout's bit for bit, and the reference."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    h, C, R = 4, 64, 16
    q, kv, pos, anc, seqs = batch([(45, 6), (70, 9), (5, 3)], h, C, R, dtype, device, g, back=2)
    want = mla_attention(q, kv, pos, anc, seqs, 0.2, C, prefix="triton", **kw)
    pool, pages, pseqs = paged(kv, seqs, 32, g)
    got = mla_attention(q, pool, pos, anc, pseqs, 0.2, C, pages=pages, page_rows=32, **kw)
    assert torch.equal(got, want)
    close(got, mla_attention_reference(q, pool, pos, anc, pseqs, 0.2, C, pages=pages, page_rows=32), dtype)
    with pytest.raises(ValueError, match="page_rows"):
        mla_attention(q, pool, pos, anc, pseqs, 0.2, C, pages=pages, page_rows=24, **kw)
