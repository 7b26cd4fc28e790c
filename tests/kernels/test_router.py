"""kernels.router: float32 router logits equal the float64 reference on fresh random inputs, and a
row's bits do not depend on the rows beside it (alone, at another offset inside a row block, among
more rows)."""
import pytest
import torch

from kernels.router import router_logits, router_logits_reference


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
