"""Fuzzing fixtures: the services on loopback in this process (``loopback.py``), a canary that
keeps one healthy greedy request running against the orchestrator during a fuzz test and
checks it stays token-identical to its autoregressive reference, and the hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE`` is not read: each test picks its own): ``fuzz-ci`` for the
fast tier (derandomized, so CI is reproducible; 50–100 cases per test), ``fuzz-slow``
for the ``slow`` tier (random, thousands of cases per test). Neither keeps an example
database (no ``.hypothesis/`` in the shared tree)."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
settings.register_profile("fuzz-ci", derandomize=True, **_COMMON)
settings.register_profile("fuzz-slow", derandomize=False, **_COMMON)


def ci(n: int) -> settings:
    """Settings of a fast-tier fuzz test with ``n`` cases."""
    return settings(settings.get_profile("fuzz-ci"), max_examples=n)


def slow(n: int) -> settings:
    """Settings of a slow-tier fuzz test with ``n`` cases (times ``SPECDEC_FUZZ_SLOW_SCALE``, 1
    unless set: a partial run)."""
    return settings(settings.get_profile("fuzz-slow"),
                    max_examples=max(1, round(n * float(os.environ.get("SPECDEC_FUZZ_SLOW_SCALE", "1")))))


#: Every call a fuzz test makes is bounded by this (seconds): a hang fails as DEADLINE_EXCEEDED.
CALL_TIMEOUT = 60.0


@pytest.fixture(scope="session")
def loopback(engines):
    """The three services over the session's engines, on loopback (started once)."""
    import loopback as lb_module

    lb, stop = lb_module.start(*engines)
    try:
        yield lb
    finally:
        stop()


@pytest.fixture(scope="session")
def channels(loopback):
    """Blocking channels to the loopback services: {"target", "draft", "orchestrator"}."""
    chs = {n: grpc.insecure_channel(getattr(loopback, n)) for n in ("target", "draft", "orchestrator")}
    yield chs
    for ch in chs.values():
        ch.close()


CANARY = dict(text="The capital of France is", max_tokens=8, tree_budget=8, ignore_eos=True)


class Canary:
    """Runs the CANARY greedy tree request in a loop on its own thread; every run must return
    the autoregressive reference's tokens."""

    def __init__(self, address: str):
        from specdec_proto.v1 import orchestrator_pb2_grpc

        self.channel = grpc.insecure_channel(address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.reference = self.run("autoregressive")
        self.runs, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="canary")

    def run(self, mode: str) -> list[int]:
        from specdec_client.client import build_request

        c = dict(CANARY)
        req = build_request(c.pop("text"), mode=mode, **c)
        ids = []
        for r in self.stub.Generate(req, timeout=CALL_TIMEOUT):
            ids += r.delta.token_ids
        return ids

    def _loop(self):
        modes = ("tree", "chain")
        while not self._stop.is_set():
            mode = modes[self.runs % 2]
            try:
                got = self.run(mode)
                if got != self.reference:
                    self.failures.append(f"{mode}: {got} != reference {self.reference}")
            except grpc.RpcError as e:
                self.failures.append(f"{mode}: {e.code()} {e.details()}")
            self.runs += 1
            self._stop.wait(1.0)  # overlaps the cases without taking most of the CPU

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(CALL_TIMEOUT + 5)
        self.channel.close()


@pytest.fixture
def canary(loopback):
    """A healthy greedy request kept running during the test; checked at its end, and then
    nothing may be left on the workers (over GetInfo)."""
    with Canary(loopback.orchestrator) as c:
        t0 = time.monotonic()
        yield c
        while c.runs == 0 and time.monotonic() - t0 < CALL_TIMEOUT:  # at least one run overlapped the test
            time.sleep(0.05)
    assert c.runs >= 1
    assert not c.failures, c.failures
    assert loopback.wait_idle() == (0, 0, 0), ("worker state leaked", loopback.held())
