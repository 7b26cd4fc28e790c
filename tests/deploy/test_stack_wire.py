"""Wire smoke tests on the real three-process stack (``deploy.local``, real gRPC on loopback,
one stack per test session): every worker RPC, health and reflection, streaming, the async
client, and a few identity prompts per mode checked against plain decoding by teacher forcing.
The full losslessness matrix runs in process (tests/orchestrator/test_lossless.py)."""
import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from bench.datasets import humaneval_prompts, mtbench_questions
from modeling.sampling import SamplingParams
from lossless_reference import greedy_divergences, sampled_divergences
from serving.tensors import from_proto
from specdec_proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

PROMPTS = [dict(prompt=humaneval_prompts(1)[0]), dict(messages=[{"role": "user", "content": mtbench_questions(1)[0]}])]
MODES = [("autoregressive", 0), ("chain", 0), ("tree", 4), ("tree", 64)]


def prompt_ids(tokenizer, p: dict) -> list[int]:
    if "prompt" in p:
        return tokenizer.encode(p["prompt"])
    return tokenizer.encode(tokenizer.apply_chat_template(p["messages"]))


@pytest.fixture(scope="module")
def served(client):
    """Greedy output of each prompt in each mode, 32 tokens, ignore_eos."""
    return {(i, m, b): client.generate(**p, max_tokens=32, mode=m, tree_budget=b, ignore_eos=True)
            for i, p in enumerate(PROMPTS) for m, b in MODES}


@pytest.mark.parametrize("mode,budget", MODES, ids=[f"{m}{b or ''}" for m, b in MODES])
def test_served_greedy_is_plain_greedy(served, tokenizer, target_model, mode, budget):
    for i, p in enumerate(PROMPTS):
        r = served[i, mode, budget]
        ids = prompt_ids(tokenizer, p)
        assert r.prompt_tokens == len(ids) and r.completion_tokens == 32 == len(r.token_ids)
        assert r.finish_reason == "length" and r.text == tokenizer.decode(r.token_ids)
        assert greedy_divergences(target_model, ids, r.token_ids)[0] is None
        assert r.token_ids == served[i, "autoregressive", 0].token_ids
        hist = r.stats.accept_length_histogram
        assert sum(hist) == r.stats.rounds and sum(k * n for k, n in enumerate(hist)) >= 31


def test_seeded_sampling_over_the_wire(client, tokenizer, target_model):
    """The wire carries temperature/top_p as float32: the servers sample with those values."""
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))
    for mode in ("autoregressive", "tree"):
        r = client.generate(**PROMPTS[1], max_tokens=24, mode=mode, tree_budget=4, temperature=0.7, top_p=0.95,
                            seed=7, ignore_eos=True)
        params = SamplingParams(f32(0.7), 0, f32(0.95), 7)
        assert sampled_divergences(target_model, prompt_ids(tokenizer, PROMPTS[1]), r.token_ids, params)[0] is None


def test_streaming_matches_generate(client, served):
    chunks = list(client.stream(**PROMPTS[1], max_tokens=32, mode="tree", tree_budget=4, ignore_eos=True))
    result, ref = chunks[-1], served[1, "tree", 4]
    assert "".join(c.text for c in chunks[:-1]) == result.text == ref.text
    assert [t for c in chunks[:-1] for t in c.token_ids] == ref.token_ids
    assert len(chunks) > 2  # several deltas, not one block


def test_async_client(stack, served):
    from specdec_client import AsyncSpecDecClient

    async def go():
        async with AsyncSpecDecClient(stack.address) as c:
            return await c.generate(**PROMPTS[0], max_tokens=32, mode="chain", ignore_eos=True)

    assert asyncio.run(go()).token_ids == served[0, "chain", 0].token_ids


def test_health_transitions_and_reflection(stack):
    """Each service reported NOT_SERVING, then SERVING (recorded while the stack started);
    reflection lists each service's API and health."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for name, seen in stack.health_seen.items():
        assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING], name
    api = {"target": "specdec.v1.TargetService", "draft": "specdec.v1.DraftService",
           "orchestrator": "specdec.v1.Orchestrator"}
    for name, port in stack.ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {api[name], "grpc.health.v1.Health"} <= services


def test_worker_rpcs_one_round(stack, tokenizer, target_model):
    """Prefill → Draft → Verify → Release called directly on the workers: the shapes on the
    wire, the accepted path is a root path of the tree, the committed tokens and the bonus are
    plain greedy decoding, GetInfo counts the live request, Release frees it."""
    prompt = tokenizer.encode("def fibonacci(n):")
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['target']}") as t, \
            grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as d:
        ts, ds = target_pb2_grpc.TargetServiceStub(t), draft_pb2_grpc.DraftServiceStub(d)
        info, dinfo = ts.GetInfo(common_pb2.InfoRequest()), ds.GetInfo(common_pb2.InfoRequest())
        width = len(info.tapped_layers) * info.hidden_size
        assert list(info.tapped_layers) == list(dinfo.target_layer_ids)
        try:
            pre = ts.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
                request_id="w1", prompt_tokens=prompt, max_new_tokens=16, return_features=True)])).results[0]
            feats = from_proto(pre.context_features)
            assert list(feats.shape) == [len(prompt), width]
            assert ts.GetInfo(common_pb2.InfoRequest()).live_requests == 1
            tree = ds.Draft(draft_pb2.DraftRequest(items=[draft_pb2.DraftItem(
                request_id="w1", context_features=pre.context_features, context_start=0,
                bonus_token=pre.first_token, mode=draft_pb2.TREE_MODE_TREE, budget=8)])).results[0].tree
            assert tree.tokens[0] == pre.first_token and len(tree.tokens) == 9 and tree.parents[0] == -1
            v = ts.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
                request_id="w1", tree=tree, return_features=True)])).results[0]
            path = list(v.accepted_nodes)
            assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:]))
            assert len(v.node_samples) == len(tree.tokens)
            assert list(from_proto(v.context_features).shape) == [len(path), width]
            out = [tree.tokens[i] for i in path] + [v.bonus_token]
            assert greedy_divergences(target_model, prompt, out)[0] is None
        finally:
            assert ts.Release(common_pb2.ReleaseRequest(request_ids=["w1"])).released == 1
            assert ds.Release(common_pb2.ReleaseRequest(request_ids=["w1"])).released == 1
        assert ts.GetInfo(common_pb2.InfoRequest()).live_requests == 0
