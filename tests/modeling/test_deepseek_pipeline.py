"""A tiny random Kimi-K2-structured target (MLA + MoE: 1 group, top-2 of 8 experts; FP8
checkpoint) with a random DFlash drafter through the orchestrator's own round loop
(in-process transport, real target and draft engines): every speculative mode's greedy
output equals autoregressive decoding (two ranks: test_deepseek_tp.py)."""
import pytest
import torch

from deploy.inprocess import InProcessDraft, InProcessTarget, run
from draft_service.engine import DraftEngine
from modeling.dflash import DFlashConfig, DFlashDrafter
from modeling.targets import load_target_model
from modeling.weights import load_embedding_and_head
from orchestrator.generation import GenerationRequest
from scripts.make_tiny_deepseek import TINY, save_tiny
from target_service.engine import TargetEngine
from test_deepseek import one_thread  # noqa: F401  (autouse fixture: one torch thread)

SMALL = dict(TINY["kimi_k2"], hidden_size=64, n_routed_experts=8, num_experts_per_tok=2)
PROMPT = [5, 9, 17, 3, 30, 11, 8, 2]
TAPS = (0, 2)


class Tokenizer:
    """Token ids as distinct characters (the tiny model has no tokenizer)."""

    def decode(self, ids):
        return "".join(chr(0x4E00 + i) for i in ids)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(checkpoint dir, in-process target client on one rank, in-process draft client)."""
    path = tmp_path_factory.mktemp("kimi-small")
    save_tiny(path, SMALL, "fp8")
    model = load_target_model(path, "cpu", torch.float32)
    _, embed, head = load_embedding_and_head(path)  # what the draft service borrows
    V = model.cfg.vocab_size
    dc = DFlashConfig(hidden_size=model.cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=64, vocab_size=V,
                      target_layer_ids=TAPS, mask_token_id=V - 1, block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dc).eval().requires_grad_(False)
    target = InProcessTarget(TargetEngine(model, TAPS, 512, 1 << 14, 16))
    return path, target, InProcessDraft(DraftEngine(drafter, embed, head, max_tree_budget=16))


def generate(target, draft, mode, budget, n=40):
    r = run(GenerationRequest("mla", PROMPT, n, mode=mode, tree_budget=budget), Tokenizer(), target,
            draft if mode != "autoregressive" else None)
    return r.token_ids, r.finished.stats.mean_accept_length


def test_speculative_greedy_equals_autoregressive(stack):
    _, target, draft = stack
    ref, _ = generate(target, draft, "autoregressive", 1)
    assert len(ref) == 40
    for mode, budget in [("chain", 1), ("tree", 4), ("tree", 16)]:
        ids, tau = generate(target, draft, mode, budget)
        assert ids == ref, (mode, budget)
    assert tau > 1  # tree@16 accepted some drafts, so multi-row commits happened
    # every request's latent cache went back (a release that raised was only logged by the round loop:
    # MLACache lacked the rows_held the paged engine's accounting reads, so each request leaked its rows)
    assert target.engine.live_requests == 0 and target.engine.reserved_tokens == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast path's bf16 case needs a GPU")
@pytest.mark.parametrize("fast", ["eager", "graphs"])
def test_bf16_fast_path_greedy_equals_autoregressive(stack, fast):
    """On a GPU, the engine's fast path for the Kimi-structured target — paged latent pool,
    ``RowInvariantDeepseek``, replayed from CUDA graphs or eager — in bf16: every speculative mode's
    greedy output equals autoregressive decoding through the same engine, and the pool returns to idle."""
    from modeling.deepseek_fast import row_invariant_

    path, _, draft = stack
    model = row_invariant_(load_target_model(path, torch.device("cuda"), torch.bfloat16))
    target = InProcessTarget(TargetEngine(model, TAPS, 512, 1 << 14, 16, fast=fast))
    ref, _ = generate(target, draft, "autoregressive", 1)
    assert len(ref) == 40
    taus = []
    for mode, budget in [("chain", 1), ("tree", 4), ("tree", 16)]:
        ids, tau = generate(target, draft, mode, budget)
        assert ids == ref, (mode, budget)
        taus.append(tau)
    assert max(taus) > 1
    assert target.engine.live_requests == 0 and target.engine.reserved_tokens == 0
