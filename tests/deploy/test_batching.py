"""Continuous batching on the workers (issue 14, ``serving.batcher``), through the real stack:
requests of mixed modes, budgets and sampling settings running at once each produce exactly
their solo output, the workers really ran their verify and draft messages in batches of more
than one (drafts also from sessions sending in lock-step), and a request cancelled mid-generation or a session sending a bad message in the
middle of them disturbs none of the others; afterwards no worker holds any state."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sessions import Session, live
from specdec_client.client import build_request
from specdec_proto.v1 import common_pb2, orchestrator_pb2_grpc
from specdec_proto.v2 import common_pb2 as v2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from test_metrics import scrape

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about rain.",
           "List three prime numbers:", "Once upon a time", "The quick brown fox"]
REQUESTS = [  # one of each kind: autoregressive, chain, trees of different budgets, greedy and seeded sampled
    dict(mode="autoregressive"),
    dict(mode="chain"),
    dict(mode="tree", tree_budget=4),
    dict(mode="tree", tree_budget=16),
    dict(mode="tree", tree_budget=8, temperature=0.8, seed=7),
    dict(mode="chain", temperature=1.0, top_k=40, seed=3),
]


def _generate(client, i: int):
    return client.generate(prompt=PROMPTS[i], max_tokens=8, ignore_eos=True, **REQUESTS[i]).token_ids


def _batched(before: dict, after: dict, op: str) -> tuple[float, float]:
    """(messages, engine calls) of the worker's ``op`` batcher between two scrapes (each call
    also timed)."""
    def d(name):
        key = (name, (("op", op),))
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert d("specdec:worker_batch_seconds_count") == d("specdec:worker_batch_size_count")
    return d("specdec:worker_batch_size_sum"), d("specdec:worker_batch_size_count")


def _cancel_mid_generation(stack, started: threading.Event) -> int:
    """A long request cancelled after its second chunk; returns the chunks it received."""
    with grpc.insecure_channel(stack.address) as ch:
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            build_request("Tell me a long story about dragons.", max_tokens=400, mode="tree", tree_budget=8,
                          ignore_eos=True))
        got = [next(call), next(call)]
        started.set()
        call.cancel()
    return len(got)


def _bad_target_message(stack, started: threading.Event) -> grpc.RpcError:
    """A raw target session that opens, then sends a tree with a parent out of range."""
    started.wait(60)
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['target']}") as ch:
        s = Session(target_pb2_grpc.TargetServiceStub(ch), "bad-verify")
        first = s.send(target_pb2.TargetMessage(open=target_pb2.TargetOpen(
            prompt_tokens=[1, 2, 3], max_new_tokens=8, mode=v2.MODE_TREE, tree_budget=4))).opened.first_token
        with pytest.raises(grpc.RpcError) as e:
            s.send(target_pb2.TargetMessage(verify=target_pb2.TargetVerify(
                tree=common_pb2.TokenTree(tokens=[first, 5, 6], parents=[-1, 0, 7]))))
    return e.value


def _bad_draft_message(stack, started: threading.Event) -> grpc.RpcError:
    """A raw draft session whose first message asks for more nodes this round than it binds."""
    started.wait(60)
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        width = stub.GetInfo(common_pb2.InfoRequest())
        rows = 3
        features = common_pb2.Tensor(dtype="float32", shape=[rows, len(width.taps) * width.hidden_size],
                                     data=bytes(4 * rows * len(width.taps) * width.hidden_size))
        msg = draft_pb2.DraftMessage(open=draft_pb2.DraftOpen(mode=v2.MODE_TREE, tree_budget=4),
                                     context_features=features, context_start=0, bonus_token=1, round_budget=9)
        with pytest.raises(grpc.RpcError) as e:
            Session(stub, "bad-draft").send(msg)
    return e.value


def _draft_burst(stack, started: threading.Event, n: int = 4, rounds: int = 3) -> list[int]:
    """n raw draft sessions sending each round's message at the same moment (a barrier), as
    lock-step requests do: the drafter batches them. Returns each reply's tree size."""
    started.wait(60)
    barrier, sizes = threading.Barrier(n), []
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        info = stub.GetInfo(common_pb2.InfoRequest())
        width = len(info.taps) * info.hidden_size

        def one(k: int):
            s = Session(stub, f"burst-{k}")
            for r in range(rounds):
                rows = 3 if r == 0 else 1
                msg = draft_pb2.DraftMessage(context_features=common_pb2.Tensor(
                    dtype="float32", shape=[rows, width], data=bytes(4 * rows * width)),
                    context_start=0 if r == 0 else 2 + r, bonus_token=10 + k)
                if r == 0:
                    msg.open.CopyFrom(draft_pb2.DraftOpen(mode=v2.MODE_TREE, tree_budget=4))
                barrier.wait(30)
                sizes.append(len(s.send(msg).tree.tokens))
            s.close()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n)))
    return sizes


def test_concurrent_mixed_requests_equal_their_solo_runs(stack, client):
    solo = [_generate(client, i) for i in range(len(REQUESTS))]
    ports = stack.metrics_ports
    before = {n: scrape(ports[n]) for n in ("target", "draft")}
    started = threading.Event()
    with ThreadPoolExecutor(len(REQUESTS) + 4) as pool:
        cancelled = pool.submit(_cancel_mid_generation, stack, started)
        bad_verify = pool.submit(_bad_target_message, stack, started)
        bad_draft = pool.submit(_bad_draft_message, stack, started)
        burst = pool.submit(_draft_burst, stack, started)
        together = list(pool.map(lambda i: _generate(client, i), range(len(REQUESTS))))
        assert cancelled.result() == 2
        e_verify, e_draft = bad_verify.result(), bad_draft.result()
        assert burst.result() == [5] * 12  # root + 4 nodes, every session every round
    assert together == solo  # token for token, each request as it ran alone
    assert e_verify.code() == grpc.StatusCode.INVALID_ARGUMENT and "parents" in e_verify.details()
    assert e_draft.code() == grpc.StatusCode.INVALID_ARGUMENT and "round_budget" in e_draft.details()

    after = {n: scrape(ports[n]) for n in ("target", "draft")}
    for role, op in (("target", "verify"), ("draft", "draft")):
        messages, calls = _batched(before[role], after[role], op)
        assert 0 < calls < messages, f"{role}: {messages} {op} messages in {calls} engine calls: never batched"
    deadline = time.monotonic() + 60
    while live(stack) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live(stack) == (0, 0, 0)  # no live request, no reserved KV, no drafter context


def test_a_draft_session_must_open_first(stack):
    """A draft session whose first message lacks ``open`` is refused with FAILED_PRECONDITION
    naming ``open`` (it used to read as a bad mode: "mode must be one of ..., got None")."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        info = stub.GetInfo(common_pb2.InfoRequest())
        width = len(info.taps) * info.hidden_size
        msg = draft_pb2.DraftMessage(context_features=common_pb2.Tensor(
            dtype="float32", shape=[3, width], data=bytes(4 * 3 * width)), context_start=0, bonus_token=1)
        with pytest.raises(grpc.RpcError) as e:
            Session(stub, "no-open").send(msg)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "open" in e.value.details()
