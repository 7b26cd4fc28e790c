"""Lossless with a draft context window (issue 9 item 4): greedy speculative decoding through the
real engines with a windowed shipped drafter equals autoregressive decoding (the drafter only
proposes). Moved out of tests/kernels so the GPU run (``--confcutdir=tests/kernels``) does not
need the CPU engines fixture."""
import torch

from draft_service.engine import DraftEngine


def test_windowed_greedy_equals_autoregressive(engines, tokenizer):
    """The shipped drafter with a 32-row window (pages of 16) in the real engines, fp32 CPU:
    greedy speculative decoding (tree@16) of a ~260-token prompt emits the autoregressive
    tokens; the drafter only proposes."""
    from deploy.inprocess import InProcessDraft, InProcessTarget, run
    from orchestrator.generation import GenerationRequest

    te, de = engines
    windowed = DraftEngine(de.drafter, de.embed, de.lm_head, max_tree_budget=64, context_page_rows=16, window=32)
    prompt = tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 12)
    assert len(prompt) > 200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for mode, draft in (("autoregressive", None), ("tree", windowed)):
            req = GenerationRequest(mode, prompt, 24, mode=mode, tree_budget=16)
            out[mode] = run(req, tokenizer, InProcessTarget(te), draft and InProcessDraft(draft)).token_ids
    finally:
        torch.set_num_threads(threads)
    assert len(out["tree"]) == 24 and out["tree"] == out["autoregressive"]
    assert windowed.live_requests == 0
