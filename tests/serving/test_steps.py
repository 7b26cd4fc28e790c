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
import time

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


def _verify_count() -> float:
    """Observations of the target's ``specdec:worker_op_seconds{op="verify"}`` (this process's hosts)."""
    from serving import metrics

    return next(x.value for m in metrics.WORKER_SECONDS.collect() for x in m.samples
                if x.name.endswith("_count") and x.labels.get("op") == "verify")


@pytest.mark.parametrize("channel", ["grpc", "socket"])
def test_requests_over_steps_equal_their_session_runs(workers, tokenizer, channel):
    """Greedy and seeded requests of every mode running together over Steps give exactly their
    output over per-request Sessions, and the steps carried several requests' rounds each; the
    worker observes every verify, on a Session or in a step, in ``worker_op_seconds``."""
    alone, _ = asyncio.run(_run_all(workers, tokenizer, channel, steps=False))
    before = _verify_count()
    together, (target, draft) = asyncio.run(_run_all(workers, tokenizer, channel, steps=True))
    assert together == alone and all(len(out) == 10 for out, _ in together)
    assert target.steps.items > target.steps.steps > 0 and draft.steps.items > draft.steps.steps > 0
    assert workers.wait_idle() == (0, 0)
    time.sleep(0.3)  # (a session's last observations are made as it ends)
    assert _verify_count() - before == sum(sum(hist) for _, hist in together)  # one per round of every request


def test_held_rows_are_fetched_on_the_requests_session(workers, tokenizer, channel="socket"):
    """An open with ``hold`` (a request that joins a one-token plan) leaves the prompt's feature
    rows with the target: its reply has none, its held one-token rounds go over Steps, and its
    first verify without hold fetches the prompt's rows and the rounds' — on the request's own
    Session, not in a step (a prompt's rows, or hundreds of held rounds', for each of many
    requests would pass a Steps message's limit) — the rows a request that never held received,
    in order."""
    import torch

    async def run(target, rid, prompt, hold):
        pre = await target.prefill(rid, prompt, 8, SamplingParams(), Mode.TREE, 4, hold=hold)
        parts, bonus, commit, held_rows = [pre.features], pre.first_token, None, []
        for k in range(4):  # three one-token rounds (held), then one that fetches
            v = await target.verify(rid, [bonus], [-1], commit, hold=hold and k < 3)
            held_rows.append(v.held_rows)
            parts.append(v.features)
            commit, bonus = v.feature_nodes, v.samples[0]
        await target.release(rid)
        rows = torch.cat([wire.tensor_from_proto(f) for f in parts if f is not None])
        return pre.features, rows, held_rows

    async def main():
        target, _ = workers.clients(channel, steps=True)
        await target.info()
        submit = target.via_steps_submit

        def recorded(request_id, item, what):  # (request, hold) of every verify that went in a step
            in_steps.append((request_id, item[4]))
            return submit(request_id, item, what)
        target.via_steps_submit = recorded
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        plain = await asyncio.gather(*(run(target, f"plain-{i}", p, False) for i, p in enumerate(prompts)))
        held = await asyncio.gather(*(run(target, f"held-{i}", p, True) for i, p in enumerate(prompts)))
        return prompts, plain, held, target

    in_steps = []
    prompts, plain, held, target = asyncio.run(main())
    for p, (_, rows, _), (opened, held_rows, counts) in zip(prompts, plain, held):
        assert opened is None and torch.equal(held_rows, rows) and counts == [0, 0, 0, len(p) + 3]
    # the fetches went on the Sessions, the held rounds (and the plain requests' rounds) in steps
    assert {hold for rid, hold in in_steps if rid.startswith("held")} == {True}
    assert any(rid.startswith("plain") for rid, _ in in_steps) and not target.holding
    assert workers.wait_idle() == (0, 0)


def test_a_hold_whose_fetch_would_pass_the_message_limit_fetches_instead(workers, tokenizer):
    """With a 128 KiB message limit (the embedded target's rows: 3 taps × 576 float32, 6.9 kB: a
    fetch of half the limit is 9 rows), 24 held one-token rounds: a hold that would make the
    held rows pass half the limit goes without hold — its reply brings them (at most 9) — and
    the rows, all of them in order, equal a never-holding request's; nothing fails."""
    import torch

    async def run(target, rid, hold):
        pre = await target.prefill(rid, tokenizer.encode(PROMPTS[0]), 30, SamplingParams(), Mode.TREE, 4, hold=hold)
        parts, bonus, commit, back = [pre.features], pre.first_token, None, []
        for k in range(25):
            v = await target.verify(rid, [bonus], [-1], commit, hold=hold and k < 24)
            parts.append(v.features)
            back.append(v.held_rows)
            commit, bonus = v.feature_nodes, v.samples[0]
        await target.release(rid)
        return torch.cat([wire.tensor_from_proto(f) for f in parts if f is not None]), back

    async def main():
        target, _ = workers.clients("grpc", steps=True)
        target.max_bytes = 2 ** 17
        await target.info()
        return await run(target, "limit-plain", False), await run(target, "limit-held", True)

    (rows, _), (held_rows, back) = asyncio.run(main())
    fetched = [n for n in back if n]
    assert torch.equal(held_rows, rows) and len(fetched) >= 3 and max(fetched) <= 9
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
        step = wire.target_step([("steps-a", [first_a, 5, 6], [-1, 0, 1], None),
                                 ("steps-b", [first_b, 5, 6], [-1, 0, 7], None),
                                 ("no-such-request", [1], [-1], None),
                                 ("steps-a", [first_a], [-1], None)])
        step.items.add(worker_id="steps-b")  # no verify at all
        got = wire.step_results(steps.send(step), "verified", wire.verified_from)
        assert got[4][0] == grpc.StatusCode.INVALID_ARGUMENT and "verify" in got[4][1]
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
        steps = Session(stub, "d-stream", rpc="Steps")
        early = wire.step_results(steps.send(wire.draft_step([("d-steps", msg(1, 0, False).context_features, 0, 7,
                                                               None)])), "tree", lambda t: t)
        assert early[0][0] == grpc.StatusCode.FAILED_PRECONDITION and "first" in early[0][1]  # before its open
        for s in sessions:
            s.send(msg(3, 0, True))
        expect = sessions[1].send(msg(1, 3, False)).tree
        feats = msg(1, 3, False).context_features
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


def test_a_steps_stream_takes_no_session_slot_and_no_drain_wait(workers):
    """A Steps stream holds no request: it is not a Session (``max_sessions`` stays for requests),
    not in flight (a drain does not wait for it), it is admitted while the worker drains (the
    rounds of requests admitted before go on), over gRPC and the data channel alike; at most
    ``MAX_STEPS_STREAMS`` at once (RESOURCE_EXHAUSTED naming the limit)."""
    from serving.server import MAX_STEPS_STREAMS
    from sessions import Session

    host = workers.hosts["target"]
    with grpc.insecure_channel(workers.addresses["target"]) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        before = host.sessions, host.in_flight
        streams = [Session(stub, f"steps-{i}", rpc="Steps") for i in range(MAX_STEPS_STREAMS)]
        for s in streams:  # (an empty step: answered with no results)
            assert len(s.send(target_pb2.TargetStep()).results) == 0
        assert (host.sessions, host.in_flight, host.steps_streams) == (*before, MAX_STEPS_STREAMS)
        with pytest.raises(grpc.RpcError) as e:
            Session(stub, "one-too-many", rpc="Steps").send(target_pb2.TargetStep())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Steps streams" in e.value.details()
        for s in streams:
            s.close()
        host.draining = True
        try:
            s = Session(stub, "while-draining", rpc="Steps")
            assert len(s.send(target_pb2.TargetStep()).results) == 0
            s.close()
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(workers.paths["target"])
            sock.sendall(dc.frame(dc.OPEN, json.dumps({"metadata": [], "rpc": "Steps"}).encode())
                         + dc.frame(dc.MESSAGE, target_pb2.TargetStep().SerializeToString()) + dc.frame(dc.END))
            f = sock.makefile("rb")
            assert [dc.read_frame(f, 1 << 20)[0] for _ in range(3)] == [dc.HELLO, dc.MESSAGE, dc.END]
            f.close()
            sock.close()
            with pytest.raises(grpc.RpcError) as e:  # (a new request is still refused)
                _open_target(stub, "while-draining-open", [1, 2, 3])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            host.draining = False
    deadline = time.monotonic() + 5
    while host.steps_streams and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (host.sessions, host.in_flight, host.steps_streams) == (*before, 0)


def test_steps_are_cut_to_the_message_limit_and_a_dead_idle_stream_is_reopened(workers, tokenizer):
    """A step whose message or reply would pass the sender's byte limit goes as several messages
    (here a limit that fits about one verify reply); a stream that ended while idle (the liveness
    probe's ``fail``, a restarted worker) is replaced before the next message, losing nothing.
    Outputs stay those of per-request Sessions."""
    from orchestrator.workers import SocketCall

    async def run():
        target, draft = workers.clients("socket", steps=True)
        await target.info()
        await draft.info()
        target.steps.limit = 3000  # bytes: a verify reply carries its accepted rows' features (576 floats each)

        async def batch():
            return await asyncio.gather(*(collect(GenerationRequest(f"cut-{i}", tokenizer.encode(PROMPTS[i]), 6,
                                                                    mode="tree", tree_budget=8), tokenizer,
                                                  target, draft) for i in range(3)))
        first = await batch()
        per_message = target.steps.items / target.steps.steps
        old = target.steps.call
        assert isinstance(old, SocketCall) and target.steps.reply_item_bytes > 0
        old.fail(grpc.StatusCode.UNAVAILABLE, "stopped answering (test: the liveness probe)")
        second = await batch()
        return first, second, per_message, target.steps.call is not old
    first, second, per_message, reopened = asyncio.run(run())
    assert [o for o, _ in first] == [o for o, _ in second] and all(len(o) == 6 for o, _ in first)
    assert per_message <= 1.5 and reopened
    assert workers.wait_idle() == (0, 0)


def test_a_deadline_reached_between_steps_reads_as_the_sessions_status(workers, tokenizer):
    """Requests whose deadline passes while their rounds go over Steps end DEADLINE_EXCEEDED (the
    status their Session ended with), not NOT_FOUND from the item that found them freed."""
    async def run():
        target, draft = workers.clients("socket", steps=True)
        await target.info()
        await draft.info()
        deadline = time.monotonic() + 1.0

        async def one(i):
            try:
                await collect(GenerationRequest(f"dl-{i}", tokenizer.encode(PROMPTS[i]), 400, mode="tree",
                                                tree_budget=8, deadline=deadline), tokenizer, target, draft)
            except Exception as e:  # (the target's error ends the request: AioRpcError)
                return e.code() if hasattr(e, "code") else type(e).__name__
            return "finished"
        return await asyncio.gather(*(one(i) for i in range(3)))
    assert asyncio.run(run()) == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3
    assert workers.wait_idle() == (0, 0)
