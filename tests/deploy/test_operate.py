"""Operating the session stack (started from the compose file): SIGTERM drains —
readiness NOT_SERVING while liveness stays SERVING, a new request is refused with UNAVAILABLE,
the in-flight one finishes, the process exits 0. (Readiness following the target, and the
orchestrator staying ready without its drafter: tests/deploy/test_reliability.py.) Each test
restarts what it stopped with the compose command and environment, so the stack serves the
tests after it."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from specdec_client import SpecDecClient, SpecDecError
from specdec_client.probe import check

ORCH = "specdec.v1.Orchestrator"
MAX_TOKENS = 48  # in flight while the drain is checked (~1 s), done well inside the 30 s grace even at ~2 tok/s


def wait_status(address: str, service: str, want: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (status := check(address, service)) != want:
        assert time.monotonic() < deadline, f"{service or 'liveness'} at {address} stayed {status}, wanted {want}"
        time.sleep(0.1)


def test_sigterm_drains(stack):
    s = stack
    result, first = {}, threading.Event()

    def in_flight():
        with SpecDecClient(s.address, timeout=300) as c:
            try:
                for item in c.stream(prompt="Count to a thousand:", max_tokens=MAX_TOKENS, ignore_eos=True,
                                     mode="autoregressive"):
                    first.set()
                    result["last"] = item
            except SpecDecError as e:
                result["error"] = e
            first.set()

    t = threading.Thread(target=in_flight)
    t.start()
    try:
        assert first.wait(120) and "error" not in result
        s.procs["orchestrator"].send_signal(signal.SIGTERM)
        wait_status(s.address, ORCH, "NOT_SERVING", timeout=30)
        assert check(s.address) == "SERVING"
        with SpecDecClient(s.address, timeout=30) as c, pytest.raises(SpecDecError) as e:
            c.generate(prompt="hi", max_tokens=4)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details
        assert t.is_alive(), "the in-flight request ended before the drain was checked"
        t.join(300)
        assert "error" not in result, result.get("error")
        assert result["last"].finish_reason == "length" and result["last"].completion_tokens == MAX_TOKENS
        assert s.procs["orchestrator"].wait(60) == 0
    finally:
        t.join(300)
        if s.procs["orchestrator"].poll() is None:
            s.procs["orchestrator"].kill()
            s.procs["orchestrator"].wait()
        s.start("orchestrator")
        s.wait_healthy("orchestrator")


@pytest.mark.slow
def test_drain_grace_period_runs_out(tmp_path):
    """A request still running when --drain-seconds ran out ends with UNAVAILABLE naming the
    grace period, the target releases it, and the orchestrator exits 0 (own stack: 1 s grace)."""
    from urllib.request import urlopen

    from deploy.compose_local import compose_stack

    s = compose_stack(str(tmp_path), env={"SPECDEC_DRAIN_SECONDS": "1"}).up()
    try:
        with SpecDecClient(s.address, timeout=300) as c:
            chunks = c.stream(prompt="Count:", max_tokens=2000, ignore_eos=True, mode="autoregressive")
            next(chunks)
            s.procs["orchestrator"].send_signal(signal.SIGTERM)
            with pytest.raises(SpecDecError) as e:
                for _ in chunks:
                    pass
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "grace period" in e.value.details
        assert s.procs["orchestrator"].wait(60) == 0
        deadline = time.monotonic() + 30
        while "specdec:num_requests_running 0.0" not in urlopen(
                f"http://127.0.0.1:{s.metrics_ports['target']}/metrics", timeout=10).read().decode():
            assert time.monotonic() < deadline, "the target kept the cut request"
            time.sleep(0.1)
    finally:
        s.stop()
