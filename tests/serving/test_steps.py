"""The ``Steps`` stream (``serving.steps`` on the workers, ``orchestrator.steps`` in the
orchestrator): many requests' rounds in one message per step per worker.

Real threaded gRPC hosts with the real servicers over the real engines, each also serving its
data channel (``test_datachannel.Workers``); the orchestrator's real clients and round loop.
Requests of mixed modes and sampling settings running at once over Steps each produce exactly
what they produce over their own Sessions (greedy: token for token; seeded sampling: the same
tokens and rounds), in fewer messages than rounds; one bad item fails only its request; a
Steps stream holds no request state; the workers end idle."""
from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest

from modeling.sampling import SamplingParams
from orchestrator.generation import GenerationRequest, generate
from protocol import wire
from protocol.types import Mode
from serving import datachannel as dc
from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import common_pb2 as v2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from test_datachannel import Workers, collect, workers  # noqa: F401 — the module-scoped fixture

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about rain.", "Once upon a time"]
REQUESTS = [  # (mode, tree budget, sampling)
    ("autoregressive", 1, SamplingParams()),
    ("chain", 1, SamplingParams()),
    ("tree", 8, SamplingParams()),
    ("tree", 4, SamplingParams(temperature=0.8, top_p=0.95, seed=1234)),
]


async def _run_all(w: Workers, tok, channel: str, steps: bool, max_tokens: int = 10):
    """Every request of REQUESTS at once through one pair of clients; returns per request
    (tokens, round histogram) and the clients."""
    target, draft = w.clients(channel, steps)
    await target.info()
    await draft.info()

    async def one(i):
        mode, budget, sampling = REQUESTS[i]
        req = GenerationRequest(f"steps-{i}", tok.encode(PROMPTS[i]), max_tokens, mode=mode, tree_budget=budget,
                                sampling=sampling)
        out, fin = await collect(req, tok, target, draft)
        return out, fin.stats.histogram
    return await asyncio.gather(*(one(i) for i in range(len(REQUESTS)))), (target, draft)


@pytest.mark.parametrize("channel", ["grpc", "socket"])
def test_requests_over_steps_equal_their_session_runs(workers, tokenizer, channel):
    """Greedy and seeded requests of every mode running together over Steps give exactly their
    output over per-request Sessions, and the steps carried several requests' rounds each."""
    alone, _ = asyncio.run(_run_all(workers, tokenizer, channel, steps=False))
    together, (target, draft) = asyncio.run(_run_all(workers, tokenizer, channel, steps=True))
    assert together == alone and all(len(out) == 10 for out, _ in together)
    assert target.steps.items > target.steps.steps > 0 and draft.steps.items > draft.steps.steps > 0
    assert workers.wait_idle() == (0, 0)


def _open_target(stub, worker_id: str, prompt: list[int]):
    from sessions import Session

    s = Session(stub, worker_id)
    first = s.send(wire.target_open(prompt, 16, SamplingParams(), Mode.TREE, 4)).opened.first_token
    return s, first


def test_a_bad_target_item_fails_only_its_request(workers):
    """In one Steps message: a good verify, a tree with a parent out of range, an unknown worker
    id and a repeated one. The good one is verified as over its Session; the others fail alone
    with their statuses (INVALID_ARGUMENT naming parents, NOT_FOUND, FAILED_PRECONDITION), and
    the refused request still verifies afterwards. Closing the Steps stream frees nothing."""
    from sessions import Session

    with grpc.insecure_channel(workers.addresses["target"]) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        a, first_a = _open_target(stub, "steps-a", [1, 2, 3, 4])
        b, first_b = _open_target(stub, "steps-b", [1, 2, 3, 4])
        ref, first_ref = _open_target(stub, "steps-ref", [1, 2, 3, 4])
        expect = wire.verified_from_proto(ref.send(wire.target_verify([first_ref, 5, 6], [-1, 0, 1], None)))
        steps = Session(stub, "steps-stream", rpc="Steps")
        reply = steps.send(wire.target_step([("steps-a", [first_a, 5, 6], [-1, 0, 1], None),
                                             ("steps-b", [first_b, 5, 6], [-1, 0, 7], None),
                                             ("no-such-request", [1], [-1], None),
                                             ("steps-a", [first_a], [-1], None)]))
        got = wire.step_results(reply, "verified", wire.verified_from)
        assert got[0].samples == expect.samples and got[0].feature_nodes == expect.feature_nodes
        assert got[1][0] == grpc.StatusCode.INVALID_ARGUMENT and "parents" in got[1][1]
        assert got[2][0] == grpc.StatusCode.NOT_FOUND
        assert got[3][0] == grpc.StatusCode.FAILED_PRECONDITION
        again = wire.step_results(steps.send(wire.target_step([("steps-b", [first_b, 5, 6], [-1, 0, 1], None)])),
                                  "verified", wire.verified_from)
        assert again[0].samples == expect.samples
        steps.close()
        assert workers.te.live_requests == 3  # the Steps stream owned none of them
        for s in (a, b, ref):
            s.close()
    assert workers.wait_idle() == (0, 0)


def test_draft_items_need_an_open_session_and_no_open(workers):
    """A draft Steps item is a request's later draft message: one whose request has no draft
    Session is NOT_FOUND, one carrying ``open`` INVALID_ARGUMENT; a good one drafts as the
    Session would (the same tree)."""
    from sessions import Session

    with grpc.insecure_channel(workers.addresses["draft"]) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        info = stub.GetInfo(common_pb2.InfoRequest())
        width = len(info.taps) * info.hidden_size

        def msg(rows, start, first):
            m = draft_pb2.DraftMessage(context_features=common_pb2.Tensor(
                dtype="float32", shape=[rows, width], data=bytes(4 * rows * width)), context_start=start,
                bonus_token=7)
            if first:
                m.open.CopyFrom(draft_pb2.DraftOpen(mode=v2.MODE_TREE, tree_budget=4))
            return m
        sessions = [Session(stub, name) for name in ("d-steps", "d-ref")]
        for s in sessions:
            s.send(msg(3, 0, True))
        expect = sessions[1].send(msg(1, 3, False)).tree
        feats = msg(1, 3, False).context_features
        steps = Session(stub, "d-stream", rpc="Steps")
        step = wire.draft_step([("d-steps", feats, 3, 7, None), ("nobody", feats, 0, 7, None)])
        bad_open = step.items.add(worker_id="d-ref")
        bad_open.draft.CopyFrom(msg(1, 4, True))
        got = wire.step_results(steps.send(step), "tree", lambda t: (t.tree.tokens[:], t.tree.parents[:]))
        assert got[0] == (expect.tokens[:], expect.parents[:])
        assert got[1][0] == grpc.StatusCode.NOT_FOUND
        assert got[2][0] == grpc.StatusCode.INVALID_ARGUMENT and "open" in got[2][1]
        steps.close()
        for s in sessions:
            s.close()
    assert workers.wait_idle() == (0, 0)


def test_cancelling_a_request_over_steps_frees_it_and_spares_the_others(workers, tokenizer):
    """A request cancelled mid-generation while another runs with it over Steps: the other
    finishes with its solo output, both workers end idle."""
    async def run():
        target, draft = workers.clients("socket", steps=True)
        await target.info()
        await draft.info()
        long = generate(GenerationRequest("c1", tokenizer.encode("Write a long essay about rivers."), 400,
                                          mode="tree", tree_budget=8), tokenizer, target, draft)
        await long.__anext__()

        task = asyncio.ensure_future(collect(GenerationRequest("c2", tokenizer.encode(PROMPTS[0]), 10, mode="tree",
                                                               tree_budget=8), tokenizer, target, draft))
        await long.__anext__()
        await long.aclose()
        return (await task)[0]
    with_cancel = asyncio.run(run())
    alone, _ = asyncio.run(_run_all(workers, tokenizer, "socket", steps=False))
    assert with_cancel == alone[0][0]  # (greedy: the same tokens in every mode)
    assert workers.wait_idle() == (0, 0)


def test_an_unknown_rpc_on_the_data_channel_is_unimplemented(workers):
    s = socket.socket(socket.AF_UNIX)
    s.connect(workers.paths["target"])
    s.sendall(dc.frame(dc.OPEN, json.dumps({"metadata": [], "rpc": "Nope"}).encode()))
    f = s.makefile("rb")
    assert dc.read_frame(f, 1 << 20)[0] == dc.HELLO
    kind, payload = dc.read_frame(f, 1 << 20)
    code, details = dc.parse_error(payload)
    assert kind == dc.ERROR and code == grpc.StatusCode.UNIMPLEMENTED and "Steps" in details
    f.close()
    s.close()


def test_a_lone_request_uses_its_session(workers, tokenizer):
    """With steps on, a request alone on the workers exchanges on its own Session (a step of one
    would only add a hop): no Steps message is sent, and the output is the same."""
    async def run(steps):
        target, draft = workers.clients("socket", steps)
        await target.info()
        await draft.info()
        out, _ = await collect(GenerationRequest("lone", tokenizer.encode(PROMPTS[0]), 10, mode="tree",
                                                 tree_budget=8), tokenizer, target, draft)
        return out, (target.steps.steps, draft.steps.steps) if steps else None
    (on, sent), (off, _) = asyncio.run(run(True)), asyncio.run(run(False))
    assert on == off and len(on) == 10 and sent == (0, 0)
    assert workers.wait_idle() == (0, 0)
