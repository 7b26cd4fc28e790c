"""Worker failures, deadlines and cancellation on the real three-process stack (issue 11).

- The draft service killed mid-generation: greedy and seeded requests in flight finish with
  exactly the autoregressive output, their stats count fallback rounds, the orchestrator stays
  ready; once the drafter is back, requests speculate again.
- The target killed mid-generation: the request ends with UNAVAILABLE within 1 s (never a
  truncated answer ending "stop"); readiness follows the target and recovers.
- A 200 ms deadline on a long generation: DEADLINE_EXCEEDED and nothing left on either worker;
  the deadline also reaches the workers' sessions (they free the request while the
  orchestrator is frozen).
- A cancelled long prefill frees the target for the next request within about one chunk.
- A hung target (SIGSTOP): the request in flight ends UNAVAILABLE within a few seconds (the
  worker links' keepalive pings), new ones are refused at once; after SIGCONT nothing is left.
- Slow tier: the drafter killed and restarted inside one request (it speculates again), and a
  frozen drafter (SIGSTOP) costing one round deadline.

Each test restarts what it stopped with the compose command and environment, so the session
stack serves the tests after it.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sessions import live
from specdec_client import SpecDecClient, SpecDecError
from specdec_client.client import GenerationResult, build_request
from specdec_client.probe import check
from specdec_proto.v1 import orchestrator_pb2_grpc

ORCH = "specdec.v1.Orchestrator"
PROMPT = dict(messages=[{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
SEEDED = dict(temperature=0.8, seed=4321)


class Stream(threading.Thread):
    """One streamed generation on its own thread: ``first`` is set when the first text chunk
    arrived (the request is live on the workers), ``result`` / ``error`` when it ended."""

    def __init__(self, address: str, **kw):
        super().__init__(daemon=True)
        self.address, self.kw = address, kw
        self.first, self.result, self.error, self.ended = threading.Event(), None, None, None
        self.start()

    def run(self):
        try:
            with SpecDecClient(self.address, timeout=600) as c:
                for item in c.stream(**self.kw):
                    self.first.set()
                    if isinstance(item, GenerationResult):
                        self.result = item
        except SpecDecError as e:
            self.error = e
        finally:
            self.ended = time.monotonic()
            self.first.set()


class Watch:
    """A grpc.health.v1 Watch stream on one service; a thread collects the statuses it sends."""

    def __init__(self, address: str, service: str):
        self.channel = grpc.insecure_channel(address)
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=service))
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for r in self.call:
                self.seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
        except grpc.RpcError:
            pass

    def close(self):
        self.call.cancel()
        self.channel.close()


def wait_until(cond, timeout: float, what: str, period: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(period)


def test_draft_killed_mid_generation_falls_back_losslessly_then_speculation_resumes(stack, client):
    s = stack
    n = 32
    log = os.path.join(s.log_dir, "orchestrator.log")
    log_start = os.path.getsize(log)
    streams = {"greedy": Stream(s.address, **PROMPT, max_tokens=n, ignore_eos=True, mode="tree", tree_budget=8),
               "seeded": Stream(s.address, **PROMPT, max_tokens=n, ignore_eos=True, mode="chain", **SEEDED)}
    try:
        for st in streams.values():
            assert st.first.wait(120) and st.error is None, st.error
        s.procs["draft"].kill()  # mid-generation: both requests hold drafter sessions
        s.procs["draft"].wait()
        s.start("draft")  # the same command and environment again (loading takes longer than the requests)
        want = {name: client.generate(**PROMPT, max_tokens=n, ignore_eos=True, mode="autoregressive", **kw).token_ids
                for name, kw in (("greedy", {}), ("seeded", SEEDED))}  # (while the drafter loads)
        for st in streams.values():
            st.join(300)
        for name, st in streams.items():
            assert st.error is None, f"{name}: {st.error}"
            r = st.result
            assert r.token_ids == want[name], f"{name}: fallback changed the output"
            assert r.finish_reason == "length" and r.stats.fallback_rounds > 0, (name, r.stats)
        assert check(s.address, ORCH) == "SERVING"  # still ready: the target alone serves
    finally:
        if s.procs["draft"].poll() is not None:
            s.start("draft")
        s.wait_healthy("draft")

    def speculating() -> bool:  # the orchestrator's probe (backoff <= 2 s) saw the drafter back
        r = client.generate(**PROMPT, max_tokens=16, ignore_eos=True, mode="tree", tree_budget=8)
        assert r.token_ids == want["greedy"][:16]
        return r.stats.fallback_rounds == 0 and r.stats.rounds < 16

    wait_until(speculating, 60, "speculation did not resume after the drafter came back", period=0.5)
    assert live(s) == (0, 0, 0)
    with open(log) as f:
        f.seek(log_start)
        events = [json.loads(line).get("event") for line in f if line.startswith("{")]
    assert events.count("draft service failed: speculation off, requests go on with one-token rounds") == 1
    assert events.count("draft service ready again: speculation resumes") == 1


def test_target_killed_mid_generation_is_unavailable_within_a_second(stack):
    s = stack
    watch = Watch(s.address, ORCH)
    try:
        with SpecDecClient(s.address, timeout=300) as c:
            chunks = c.stream(**PROMPT, max_tokens=400, ignore_eos=True, mode="tree", tree_budget=8)
            next(chunks)
            killed = time.monotonic()
            s.procs["target"].kill()
            with pytest.raises(SpecDecError) as e:
                for item in chunks:
                    assert not isinstance(item, GenerationResult), "a truncated answer was returned as finished"
            waited = time.monotonic() - killed
        assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
        assert waited < 1.0, f"the client learned of the dead target after {waited:.2f} s"
        s.procs["target"].wait()
        wait_until(lambda: check(s.address, ORCH) == "NOT_SERVING", 30, "readiness did not follow the target")
        assert check(s.address) == "SERVING"  # alive: liveness is not readiness
        with SpecDecClient(s.address, timeout=60) as c, pytest.raises(SpecDecError) as e:
            c.generate(prompt="hi", max_tokens=4)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        if s.procs["target"].poll() is None:
            s.procs["target"].kill()
            s.procs["target"].wait()
        s.start("target")
        s.wait_healthy("target")
    wait_until(lambda: check(s.address, ORCH) == "SERVING", 30, "readiness did not recover")
    wait_until(lambda: watch.seen[-1:] == ["SERVING"], 10, "Watch did not stream the recovery")
    watch.close()
    assert watch.seen == ["SERVING", "NOT_SERVING", "SERVING"]  # Watch streamed the changes
    with SpecDecClient(s.address, timeout=120) as c:
        assert c.generate(prompt="hi", max_tokens=4, mode="tree").completion_tokens > 0
    wait_until(lambda: live(s) == (0, 0, 0), 10, "the drafter kept the failed request's context")


def test_deadline_exceeded_frees_both_workers(stack):
    with grpc.insecure_channel(stack.address) as ch:
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            build_request(**PROMPT, max_tokens=400, ignore_eos=True, mode="tree", tree_budget=8), timeout=0.2)
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: live(stack) == (0, 0, 0), 30, "a worker kept the expired request")


def end_events(stack, request_id: str) -> list[dict]:
    """The orchestrator's "finished" / "ended" log lines of ``request_id``."""
    with open(os.path.join(stack.log_dir, "orchestrator.log")) as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    return [e for e in lines if e.get("request_id") == request_id and e.get("event") in ("finished", "ended")]


def test_cancelled_and_expired_requests_log_one_end_event(stack):
    """Every request logs one end line: a client that cancels mid-stream → "ended" with outcome
    CANCELLED, one whose deadline passes → DEADLINE_EXCEEDED (newcomer: a cancelled request
    left no end line)."""
    rid = f"cancel-{time.monotonic_ns()}"
    with grpc.insecure_channel(stack.address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        call = stub.Generate(build_request(**PROMPT, max_tokens=400, ignore_eos=True, request_id=rid + "-c"))
        next(call)
        call.cancel()
        call = stub.Generate(build_request(**PROMPT, max_tokens=400, ignore_eos=True, request_id=rid + "-d"),
                             timeout=1.0)
        with pytest.raises(grpc.RpcError):
            for _ in call:
                pass
    wait_until(lambda: len(end_events(stack, rid + "-c")) and len(end_events(stack, rid + "-d")), 10,
               "no end line for the cancelled or the expired request")
    time.sleep(0.2)  # (a second end line would show now)
    (c,), (d,) = end_events(stack, rid + "-c"), end_events(stack, rid + "-d")
    assert (c["event"], c["outcome"], d["event"], d["outcome"]) == ("ended", "CANCELLED", "ended", "DEADLINE_EXCEEDED")
    assert c["tokens"] >= 1
    wait_until(lambda: live(stack) == (0, 0, 0), 30, "a worker kept a cancelled request")


def test_streams_cancelled_right_after_the_final_message_leak_nothing(stack):
    """A client that stops reading as soon as the Final message arrives (cancelling while the
    orchestrator still ends the target's session) leaves no draft session behind (break test:
    5 of 8 leaked before the releases were shielded)."""
    with grpc.insecure_channel(stack.address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        for i in range(8):
            call = stub.Generate(build_request(prompt=f"Count to {i + 3}.", max_tokens=4, mode="tree", tree_budget=8))
            for msg in call:
                if msg.HasField("final"):
                    call.cancel()
                    break
    wait_until(lambda: live(stack) == (0, 0, 0), 30, "a draft session outlived its cancelled stream")


def test_frozen_drafter_with_a_short_client_deadline_falls_back(stack, client):
    """With the drafter frozen (SIGSTOP) and a client deadline shorter than the round deadline,
    the request still completes on one-token rounds: a draft may take at most half of what is
    left of the request's deadline (break test: all such requests failed DEADLINE_EXCEEDED)."""
    s = stack
    want = client.generate(prompt="hi", max_tokens=4, ignore_eos=True, mode="autoregressive")
    budget = max(1.5, 6 * want.stats.verify_seconds + 0.5)  # room for ~4 one-token rounds here
    s.procs["draft"].send_signal(signal.SIGSTOP)
    try:
        with SpecDecClient(s.address, timeout=budget) as c:
            got = c.generate(prompt="hi", max_tokens=4, ignore_eos=True, mode="tree", tree_budget=8)
    finally:
        s.procs["draft"].send_signal(signal.SIGCONT)
    assert got.token_ids == want.token_ids and got.stats.fallback_rounds > 0
    wait_until(lambda: live(s) == (0, 0, 0), 30, "a worker kept the request")


def test_hung_target_fails_requests_in_flight_fast_and_refuses_new_ones(stack):
    """A hung target (SIGSTOP: alive, not answering). The request in flight ends UNAVAILABLE
    within about one keepalive ping interval + timeout (--worker-ping-ms 1 s +
    --worker-ping-timeout-ms 2 s), naming the target and what timed out (break test: it waited
    for the client's deadline); readiness turns NOT_SERVING and a new request is refused
    UNAVAILABLE at once (break test: it hung until its 10 s deadline). After SIGCONT both workers
    free the failed request and serving resumes."""
    s = stack
    st = Stream(s.address, **PROMPT, max_tokens=400, ignore_eos=True, mode="tree", tree_budget=8)
    assert st.first.wait(120) and st.error is None, st.error
    s.procs["target"].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        st.join(60)
        assert st.result is None, "the request finished although the target hangs"
        assert st.error is not None and st.error.code == grpc.StatusCode.UNAVAILABLE, st.error
        assert "target service at" in st.error.details and "keepalive ping" in st.error.details, st.error.details
        assert st.ended - stopped < 6, f"the request in flight failed {st.ended - stopped:.1f} s after the hang"
        wait_until(lambda: check(s.address, ORCH) == "NOT_SERVING", 30, "readiness did not see the hung target")
        t0 = time.monotonic()
        with SpecDecClient(s.address, timeout=20) as c, pytest.raises(SpecDecError) as e:
            c.generate(prompt="hi", max_tokens=4, mode="tree")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "target" in e.value.details
        assert time.monotonic() - t0 < 2
    finally:
        s.procs["target"].send_signal(signal.SIGCONT)
    wait_until(lambda: check(s.address, ORCH) == "SERVING", 30, "readiness did not recover")
    with SpecDecClient(s.address, timeout=120) as c:
        assert c.generate(prompt="hi", max_tokens=4, mode="tree").completion_tokens > 0
    wait_until(lambda: live(s) == (0, 0, 0), 30, "a worker kept the request that failed while the target hung")


def test_workers_end_the_request_at_the_deadline_by_themselves(stack):
    """The deadline travels with the worker sessions: with the orchestrator frozen (SIGSTOP),
    both workers still free the request when it passes."""
    s = stack
    orch = s.procs["orchestrator"]
    with grpc.insecure_channel(s.address) as ch:
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            build_request(**PROMPT, max_tokens=400, ignore_eos=True, mode="tree", tree_budget=8), timeout=3)
        next(call), next(call)  # the prefill's token, then a drafted round's
        try:
            orch.send_signal(signal.SIGSTOP)
            assert live(s)[0] == 1 and live(s)[2] == 1  # held on both workers
            wait_until(lambda: live(s) == (0, 0, 0), 30, "the workers kept the request past its deadline")
        finally:
            orch.send_signal(signal.SIGCONT)
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with SpecDecClient(s.address, timeout=120) as c:
        assert c.generate(prompt="hi", max_tokens=4, mode="tree").completion_tokens > 0


def test_cancelled_long_prefill_frees_the_target(stack):
    """A request cancelled during a 3584-token prefill (7 chunks of 512) stops at a chunk
    boundary: the next request is answered within about one chunk's time, not after the rest
    of the prefill. ``chunk`` is measured here: one 512-token prefill (+ its one round)."""
    ids = lambda n, start: [(start + 7 * i) % 40000 + 100 for i in range(n)]
    with SpecDecClient(stack.address, timeout=300) as c:
        t0 = time.monotonic()
        c.generate(token_ids=ids(512, 1), max_tokens=1, mode="autoregressive")
        chunk = time.monotonic() - t0
        with grpc.insecure_channel(stack.address) as ch:
            long = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
                build_request(token_ids=ids(3584, 2), max_tokens=8, mode="tree", tree_budget=8))
            time.sleep(chunk / 2)  # inside the long prefill
            cancelled = time.monotonic()
            long.cancel()
        r = c.generate(token_ids=ids(8, 3), max_tokens=1, mode="autoregressive")
        waited = time.monotonic() - cancelled
    assert r.completion_tokens == 1
    # the rest of the long prefill would take ~6 more chunks; stopping at the next boundary
    # leaves at most one chunk (+ the short request itself)
    assert waited < 2.5 * chunk, f"next request waited {waited:.1f} s; one chunk takes ~{chunk:.1f} s"
    wait_until(lambda: live(stack) == (0, 0, 0), 30, "the cancelled prefill kept KV")


@pytest.mark.slow
def test_drafter_restarted_within_one_request(stack, client):
    """Kill and restart the drafter during one long greedy request: rounds before the kill
    speculate, the ones during the outage emit one token each, and after the restart the same
    request opens a new draft session (fed the kept feature rows) and speculates again; the
    output is the autoregressive one."""
    s = stack
    n = 600
    want = client.generate(**PROMPT, max_tokens=n, ignore_eos=True, mode="autoregressive").token_ids
    got, sizes, marks = [], [], {}
    with SpecDecClient(s.address, timeout=900) as c:
        for item in c.stream(**PROMPT, max_tokens=n, ignore_eos=True, mode="tree", tree_budget=8):
            if isinstance(item, GenerationResult):
                result = item
                continue
            got += item.token_ids
            sizes.append(len(item.token_ids))
            if len(sizes) == 5:
                s.procs["draft"].kill()
                s.procs["draft"].wait()
                marks["killed"] = len(sizes)
                s.start("draft")
            if "killed" in marks and "back" not in marks and len(sizes) % 10 == 0 and check(
                    f"127.0.0.1:{s.ports['draft']}", "specdec.v2.DraftService") == "SERVING":
                marks["back"] = len(sizes)
    if "back" not in marks:
        s.wait_healthy("draft")
    assert got == want and result.token_ids == want
    assert result.stats.fallback_rounds > 0
    assert "back" in marks, "the request ended before the drafter was back; raise n"
    assert max(sizes[marks["back"]:]) >= 2, "no multi-token round after the drafter came back"


@pytest.mark.slow
def test_drafter_frozen_mid_generation_misses_the_round_deadline(stack, client):
    """A drafter that stops answering (SIGSTOP) costs one round deadline (--draft-timeout-ms,
    2 s), then the request goes on with one-token rounds to the same output; once it runs again
    the probe finds it and requests speculate again, and it kept no context."""
    s = stack
    want = client.generate(**PROMPT, max_tokens=24, ignore_eos=True, mode="autoregressive").token_ids
    st = Stream(s.address, **PROMPT, max_tokens=24, ignore_eos=True, mode="tree", tree_budget=8)
    assert st.first.wait(120)
    s.procs["draft"].send_signal(signal.SIGSTOP)
    try:
        st.join(300)
    finally:
        s.procs["draft"].send_signal(signal.SIGCONT)
    assert st.error is None and st.result.token_ids == want and st.result.stats.fallback_rounds > 0

    def speculating() -> bool:
        r = client.generate(**PROMPT, max_tokens=16, ignore_eos=True, mode="tree", tree_budget=8)
        return r.stats.fallback_rounds == 0 and r.stats.rounds < 16

    wait_until(speculating, 60, "speculation did not resume after the drafter ran again", period=0.5)
    wait_until(lambda: live(s) == (0, 0, 0), 30, "the drafter kept the timed-out session")
