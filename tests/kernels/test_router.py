"""specdec_kernels.router: float32 router logits equal the float64 reference on fresh random inputs, and a
row's bits do not depend on the rows beside it (alone, at another offset inside a row block, among
more rows)."""
import pytest
import torch

from specdec_kernels.router import router_logits, router_logits_reference


@pytest.mark.parametrize("xdtype, blocks", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.bfloat16, (4, 8, 64, 4, 2, 3))])  # split-K: 3 runs
def test_router_logits_match_reference_and_are_row_invariant(device, xdtype, blocks):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for M, N, K in [(1, 10, 300), (9, 16, 512), (37, 6, 260)]:  # N, K not multiples of the blocks; M across blocks
        x = torch.randn(M, K, generator=g).to(device, xdtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device)
        out = router_logits(x, w, blocks)
        assert out.dtype == torch.float32 and out.shape == (M, N)
        want = router_logits_reference(x, w)
        assert (out.double() - want).abs().max().item() <= 1e-5 * (want.abs().max().item() + 1e-6)
        for i in {0, M // 2, M - 1}:
            assert torch.equal(router_logits(x[i:i + 1], w, blocks)[0], out[i])
            other = torch.randn(5, K, generator=g).to(device, xdtype)
            shifted = router_logits(torch.cat([other, x[i:i + 1], other]), w, blocks)
            assert torch.equal(shifted[5], out[i])


def test_router_logits_refuse_a_non_float32_weight_or_mismatched_shapes(device):
    x = torch.randn(2, 64).to(device)
    with pytest.raises(ValueError, match="float32"):
        router_logits(x, torch.randn(4, 64).to(device, torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[N, 64\]"):
        router_logits(x, torch.randn(4, 32).to(device))
    with pytest.raises(ValueError, match="blocks"):
        router_logits(x, torch.randn(4, 64).to(device), (8, 3, 256, 4, 1, 1))


@pytest.mark.parametrize("E, k, G, TG, norm", [(384, 8, 1, 1, True), (64, 6, 8, 4, True), (48, 3, 6, 2, False),
                                               (8, 2, 8, 3, True)])  # Kimi-K2; DeepSeek-V3's grouping; 1 per group
def test_route_matches_reference_selection_and_weights(device, E, k, G, TG, norm):
    """The one-launch routing picks the float64 reference's experts in its order and weights them
    within float32 rounding; a row's result does not depend on the other rows."""
    from specdec_kernels.router import route, route_reference

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    T = 13
    logits = torch.randn(T, E, generator=g).to(device) * 3
    bias = torch.randn(E, generator=g).to(device) * 0.5
    ids, w = route(logits, bias, k, G, TG, norm, 2.5)
    want_ids, want_w = route_reference(logits.cpu(), bias.cpu(), k, G, TG, norm, 2.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
    assert torch.equal(ids.cpu(), want_ids)
    assert (w.cpu().double() - want_w).abs().max().item() <= 1e-6 * want_w.abs().max().item()
    one_ids, one_w = route(logits[5:6], bias, k, G, TG, norm, 2.5)
    assert torch.equal(one_ids[0], ids[5]) and torch.equal(one_w[0], w[5])
    with pytest.raises(ValueError, match="groups"):
        route(logits, bias, E // G * TG + 1, G, TG)


def test_route_gives_distinct_in_range_ids_for_nan_and_all_equal_logits(device):
    """A row of NaN logits (a broken hidden state) or of equal scores still yields k distinct experts
    below E — the grouped MoE kernels index memory with them."""
    from specdec_kernels.router import route

    logits = torch.zeros(3, 40)
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    ids, w = route(logits.to(device), torch.zeros(40).to(device), 8, 4, 2)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < 40)).all()
    assert all(len(set(row.tolist())) == 8 for row in ids)
    assert torch.equal(ids[2], torch.arange(8))  # equal scores: the lowest ids of the kept groups, in order
    ids, _ = route(torch.full((1, 40), float("nan")).to(device), torch.zeros(40).to(device), 20, 4, 2)
    assert torch.equal(ids[0].cpu(), torch.arange(20))  # all NaN: 20 distinct ids, none out of range


def test_router_and_route_refuse_bad_arguments(device):
    """Shapes, dtypes and counts a host can check give ValueError (a short bias was read past its end)."""
    from specdec_kernels.router import route

    x, w = torch.randn(2, 64).to(device), torch.randn(4, 64).to(device)
    for bad in [(x[0], w), (x, w[0]), (x.double(), w), (x.int(), w)]:
        with pytest.raises(ValueError, match="router_logits"):
            router_logits(*bad)
    with pytest.raises(ValueError, match="blocks"):
        router_logits(x, w, ())
    logits = torch.randn(2, 8).to(device)
    for args in [(logits, torch.zeros(4).to(device), 2), (logits, torch.zeros(16).to(device), 2),
                 (logits[0], torch.zeros(8).to(device), 2), (logits, torch.zeros(8).to(device), 2.0),
                 (logits, torch.zeros(8).to(device), True), (logits, torch.zeros(8).to(device), 2, 2.0)]:
        with pytest.raises(ValueError, match="route"):
            route(*args)
