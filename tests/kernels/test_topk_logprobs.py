"""The two-launch top-K log-probs (``specdec_kernels.topk_logprobs``) equal the float64 reference: the
same ids in the same order (equal logits by smaller id, as a stable descending argsort ranks
them), log-probs within float32 rounding of log_softmax; the drafter's full build (this top-K
+ ``specdec_kernels.ddtree_build``) gives the reference tree on continuous logits. CPU (Triton
interpreter): small shapes with several chunks per row; GPU: the serving shape V = 49152."""
import numpy as np
import pytest
import torch
from conftest import DEVICE

from draft_service.ddtree import build_ddtree_reference
from specdec_kernels.ddtree_build import build_ddtree_topk
from specdec_kernels.topk_logprobs import MAX_K, topk_log_probs, topk_log_probs_reference


def check(logits, k, chunk):
    lp, ids = topk_log_probs(logits, k, chunk)
    want_lp, want_ids = topk_log_probs_reference(logits, k)
    assert lp.shape == ids.shape == logits.shape[:-1] + (k,) and lp.dtype == torch.float32
    assert torch.equal(ids, want_ids), (k, chunk)
    assert torch.allclose(lp.double(), want_lp, rtol=0, atol=2e-6), (lp.double() - want_lp).abs().max()
    assert bool((lp <= 0).all()) and bool((lp[..., 1:] <= lp[..., :-1]).all())


@pytest.mark.parametrize("shape,k,chunk", [((2, 100), 8, 32), ((1, 2, 70), 1, 32), ((1, 5), 5, 8)])
def test_matches_reference_with_ties(shape, k, chunk):
    """Several chunks per row (V not a multiple of the chunk), half of each row rounded to
    integers so equal logits occur, including across chunk boundaries."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=g) * 3
    x[..., : shape[-1] // 2] = x[..., : shape[-1] // 2].round()
    check(x.to(DEVICE), k, chunk)


def test_full_build_equals_reference_tree():
    """The drafter's path at a small shape: fused top-K, then the one-launch kernel, builds the
    literal reference's tree (continuous logits: no near-ties for ulp-level lse differences)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 60, generator=g) * 3
    for budget in (8,):
        top = topk_log_probs(logits.to(DEVICE), budget, 16)
        nodes, _, _ = build_ddtree_topk(*top, torch.tensor([7], device=DEVICE), budget)
        ref = build_ddtree_reference(logits[0].numpy(), 7, budget)
        assert nodes[0, 0].tolist() == ref.tokens.tolist() and nodes[0, 1].tolist() == ref.parents.tolist()


def test_bad_arguments_raise():
    x = torch.zeros(2, 10, device=DEVICE)
    for k, chunk in ((0, 16), (11, 16), (MAX_K + 1, 128), (4, 12), (8, 4)):
        with pytest.raises(ValueError):
            topk_log_probs(x if k <= MAX_K else torch.zeros(1, 1000, device=DEVICE), k, chunk)


@pytest.mark.skipif(DEVICE != "cuda", reason="full sizes on the GPU")
def test_serving_shape_bf16_logits():
    """D = 7 rows of V = 49152 logits rounded through bf16 (many exact ties), every k the
    drafter's buckets use, and the drafter's own tensor layout [1, 7, V]."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, 7, 49152, generator=g) * 3).bfloat16().float().to(DEVICE)
    for k in (1, 2, 4, 16, 33, 64):
        check(x, k, 2048)
