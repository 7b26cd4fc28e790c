"""Wire smoke tests on the real three-process stack (``deploy.local``, real gRPC on loopback,
one stack per test session): every worker RPC, health and reflection, streaming, the async
client, and a few identity prompts per mode checked against plain decoding by teacher forcing.
The full losslessness matrix runs in process (tests/orchestrator/test_lossless.py)."""
import asyncio

import grpc
import pytest
import torch

from bench.datasets import humaneval_prompts, mtbench_questions
from modeling.sampling import SamplingParams
from lossless_reference import greedy_divergences, sampled_divergences
from protocol.wire import tensor_from_proto as from_proto
from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import draft_pb2_grpc, target_pb2_grpc

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
    """While the stack started, each service's readiness (its full name) went NOT_SERVING →
    SERVING while its liveness ("") was SERVING throughout; reflection lists each service's API
    and health."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for name in stack.ports:
        assert stack.readiness_seen[name] == ["NOT_SERVING", "SERVING"], name
        assert stack.liveness_seen[name] == ["SERVING"], name
    api = {"target": "specdec.v2.TargetService", "draft": "specdec.v2.DraftService",
           "orchestrator": "specdec.v1.Orchestrator"}
    for name, port in stack.ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {api[name], "grpc.health.v1.Health"} <= services


def test_worker_sessions_two_rounds(stack, tokenizer, target_model):
    """Both workers' v2 sessions driven directly: open, draft (features forwarded untouched),
    verify, walk, commit riding on the next verify. Shapes on the wire, the feature rows are
    the walked path, the emitted tokens are plain greedy decoding, GetInfo counts the live
    request, ending the streams frees it."""
    from modeling import acceptance
    from sessions import Session, live
    from specdec_proto.v2 import common_pb2 as v2, draft_pb2, target_pb2

    prompt = tokenizer.encode("def fibonacci(n):")
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['target']}") as t, \
            grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as d:
        ts, ds = target_pb2_grpc.TargetServiceStub(t), draft_pb2_grpc.DraftServiceStub(d)
        info, dinfo = ts.GetInfo(common_pb2.InfoRequest()), ds.GetInfo(common_pb2.InfoRequest())
        width = len(info.taps) * info.hidden_size
        assert list(info.taps) == list(dinfo.taps) and dinfo.max_context > 0
        target, draft = Session(ts, "w1"), Session(ds, "w1")
        opened = target.send(target_pb2.TargetMessage(open=target_pb2.TargetOpen(
            prompt_tokens=prompt, max_new_tokens=16, mode=v2.MODE_TREE, tree_budget=8))).opened
        assert list(from_proto(opened.context_features).shape) == [len(prompt), width]
        assert live(stack)[:2] == (1, len(prompt) + 16 + 8 + 1) and live(stack)[2] == 0
        out, features, start, bonus, commit = [opened.first_token], opened.context_features, 0, opened.first_token, []
        for r in range(2):
            msg = draft_pb2.DraftMessage(context_features=features, context_start=start, bonus_token=bonus)
            if r == 0:
                msg.open.CopyFrom(draft_pb2.DraftOpen(mode=v2.MODE_TREE, tree_budget=8))
            tree = draft.send(msg).tree
            assert tree.tokens[0] == bonus and len(tree.tokens) == 9 and tree.parents[0] == -1
            v = target.send(target_pb2.TargetMessage(verify=target_pb2.TargetVerify(commit=commit, tree=tree))).verified
            assert len(v.samples) == len(v.edge_probs) == 9
            path, bonus = acceptance.resolve(list(tree.tokens), list(tree.parents), list(v.samples))
            assert list(v.feature_nodes) == path
            assert list(from_proto(v.context_features).shape) == [len(path), width]
            out += [tree.tokens[i] for i in path[1:]] + [bonus]
            start, features, commit = start + features.shape[0], v.context_features, path
        assert live(stack)[2] == 1
        assert greedy_divergences(target_model, prompt, out)[0] is None
        target.close()
        draft.close()
    assert live(stack) == (0, 0, 0)


def test_worker_log_lines_carry_the_client_request_id(stack, client):
    """Every worker log line of a request carries the client's request_id and the worker id
    (sent as gRPC metadata), so worker logs join the orchestrator's; the start-up warm-up
    request's carry "warmup"."""
    import json
    import pathlib
    import time

    client.generate(prompt="One two three", max_tokens=4, mode="tree", tree_budget=4, request_id="log-probe-1")
    time.sleep(0.5)  # the workers log "released" as the streams end
    def records(text: str) -> list[dict]:
        """JSON log records, also where two share a line (seen once in CI: a record written while
        another writer's line was unterminated — stdout and stderr share the file)."""
        out, dec = [], json.JSONDecoder()
        for line in text.splitlines():
            i = line.find("{")
            while i >= 0:
                try:
                    rec, end = dec.raw_decode(line, i)
                except json.JSONDecodeError:
                    break
                out.append(rec)
                i = line.find("{", end)
        return out

    for name in ("target", "draft"):
        lines = records((pathlib.Path(stack.log_dir) / f"{name}.log").read_text())
        mine = [x for x in lines if x.get("request_id") == "log-probe-1"]
        assert mine and all(x.get("worker_id") for x in mine), name
        assert len({x["worker_id"] for x in mine}) == 1
        # the orchestrator's start-up warm-up request logs under its own id, not an empty one
        assert any(x.get("request_id") == "warmup" and x.get("worker_id") for x in lines), name
