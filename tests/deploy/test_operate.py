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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_orchestrator_starts_without_the_drafter_and_speculates_once_it_is_up(engines):
    """Only the target is up: the orchestrator still starts and serves (one-token rounds, the
    autoregressive tokens); once the draft service comes up on its address the readiness
    follower ends the outage by itself (no request has to probe first) and the next request
    speculates with no fallback round. Real gRPC hosts on loopback in this process."""
    import asyncio

    import structlog

    import draft_service.__main__ as draft_main
    import orchestrator.__main__ as orchestrator_main
    import target_service.__main__ as target_main
    from serving.server import ServiceHost

    te, de = engines
    draft_address = f"127.0.0.1:{_free_port()}"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="no-drafter-servers")
    thread.start()
    hosts: dict = {}

    async def start_target_and_orchestrator():
        hosts["target"] = ServiceHost([target_main.ROLE.service])
        target_main.register(hosts["target"], {"engine": te})
        target = f"127.0.0.1:{await hosts['target'].start('127.0.0.1:0')}"
        await hosts["target"].set_status(True)
        args = orchestrator_main.parse_args(["--target", target, "--draft", draft_address, "--worker-timeout", "30"])
        host = hosts["orchestrator"] = ServiceHost([ORCH])
        state: dict = {}
        orchestrator_main.register(host, state)
        address = f"127.0.0.1:{await host.start('127.0.0.1:0')}"
        load_and_warm, warm_async = await orchestrator_main.prepare(args, host, state, structlog.get_logger())
        await asyncio.to_thread(load_and_warm)
        await warm_async()
        await host.set_status(True)
        hosts["follow"] = asyncio.create_task(orchestrator_main.follow(host, state, structlog.get_logger()))
        return address, state

    async def start_drafter():
        hosts["draft"] = ServiceHost([draft_main.ROLE.service])
        draft_main.register(hosts["draft"], {"engine": de})
        await hosts["draft"].start(draft_address)
        await hosts["draft"].set_status(True)

    def on_loop(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    prompt = dict(prompt="The capital of France is", max_tokens=8, ignore_eos=True)
    try:
        address, state = on_loop(start_target_and_orchestrator())
        assert check(address, ORCH) == "SERVING"
        with SpecDecClient(address, timeout=120) as c:
            want = c.generate(**prompt, mode="autoregressive")
            without = c.generate(**prompt, mode="tree", tree_budget=8)
            chain = c.generate(**prompt, mode="chain")  # (its session opened before the block size is known)
        assert without.token_ids == want.token_ids == chain.token_ids
        assert without.stats.fallback_rounds == without.stats.rounds > 0
        from bench.acceptance_services import wait_for_drafter

        with SpecDecClient(address, timeout=120) as c:  # a bench must not measure this state as the drafter's τ
            with pytest.raises(TimeoutError, match="still not used"):
                wait_for_drafter(c, 8, timeout=0.5)
        on_loop(start_drafter())
        deadline = time.monotonic() + 20
        while not state["draft_health"].up:  # the follower checks every second
            assert time.monotonic() < deadline, "the outage did not end after the draft service came up"
            time.sleep(0.1)
        with SpecDecClient(address, timeout=120) as c:
            wait_for_drafter(c, 8, timeout=60)
            got = c.generate(**prompt, mode="tree", tree_budget=8)
        assert got.token_ids == want.token_ids
        assert got.stats.fallback_rounds == 0 and got.stats.rounds < want.stats.rounds
    finally:
        async def down():
            if "follow" in hosts:
                hosts.pop("follow").cancel()
            for h in hosts.values():
                await h.server.stop(grace=None)
        on_loop(down(), 30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_unreachable_target_is_one_clean_error_line(tmp_path):
    """An orchestrator whose target never answers (wrong address, or TLS it was not told
    about) exits 1 after --worker-timeout with one error line naming the address and a hint,
    and no traceback (a process: what an operator sees)."""
    import os
    import subprocess
    import sys

    target = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, SPECDEC_WORKER_TIMEOUT="1")
    r = subprocess.run([sys.executable, "-m", "orchestrator", "--port", "0", "--target", target],
                       capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "never awaited" not in out, out
    line = next(ln for ln in out.splitlines() if "did not become SERVING" in ln)
    assert target in line and "--worker-tls-ca" in line and '"level": "error"' in line


def test_waiting_for_a_worker_is_logged_with_its_last_error():
    """While the target does not answer, the wait logs "waiting for … at <address>: <error>"
    every ``every`` seconds (10 in the service)."""
    import asyncio

    import structlog
    from structlog.testing import capture_logs

    from orchestrator.workers import WorkerTimeout, wait_serving

    address = f"127.0.0.1:{_free_port()}"

    async def wait():
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(WorkerTimeout) as e:
                await wait_serving(ch, "specdec.v2.TargetService", 1.2, structlog.get_logger(), "target service",
                                   address, every=0.4)
        return str(e.value)

    with capture_logs() as logs:
        error = asyncio.run(wait())
    waits = [e["event"] for e in logs if e["event"].startswith("waiting for target service")]
    assert len(waits) >= 2 and all(address in w and "UNAVAILABLE" in w for w in waits), logs
    assert address in error and "UNAVAILABLE" in error


@pytest.mark.parametrize("package, renamed", [
    ("orchestrator", {"--host": "SPECDEC_ORCHESTRATOR_HOST", "--target": "SPECDEC_TARGET_ADDRESS",
                      "--draft": "SPECDEC_DRAFT_ADDRESS", "--max-tokens": "SPECDEC_MAX_TOKENS_LIMIT",
                      "--drain-seconds": "SPECDEC_DRAIN_SECONDS"}),
    ("target_service", {"--port": "SPECDEC_TARGET_PORT", "--model": "SPECDEC_TARGET_MODEL",
                        "--kv-pool-tokens": "SPECDEC_KV_POOL_TOKENS"}),
    ("draft_service", {"--port": "SPECDEC_DRAFT_PORT", "--seed": "SPECDEC_DRAFTER_SEED"}),
])
def test_help_names_each_flags_environment_variable(package, renamed, capsys, monkeypatch):
    """--help shows ``usage: python -m <package>`` and, per flag, the variable that sets it (the
    old names kept where they differ from SPECDEC_<FLAG>); setting the variable sets the flag."""
    import importlib

    main = importlib.import_module(f"{package}.__main__")
    with pytest.raises(SystemExit):
        main.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith(f"usage: python -m {package} ")
    for flag, var in renamed.items():
        assert f"{flag} " in text and f"[env {var};" in text, (flag, var)
    flag, var = next(iter(renamed.items()))
    monkeypatch.setenv(var, "7")
    assert str(getattr(main.parse_args([]), flag[2:].replace("-", "_"))) == "7"


@pytest.mark.parametrize("package, argv, env, message", [
    ("target_service", ["--prefill-chunk", "0"], {}, "--prefill-chunk must be >= 1 (got 0)"),
    ("target_service", [], {"SPECDEC_KV_POOL_TOKENS": "-5"}, "--kv-pool-tokens must be >= 1 (got -5)"),
    ("target_service", ["--max-tree-nodes", "0"], {}, "--max-tree-nodes must be >= 1 (got 0)"),
    ("draft_service", ["--max-budget", "0"], {}, "--max-budget must be >= 1 (got 0)"),
])
def test_out_of_range_flags_are_a_usage_error(package, argv, env, message, capsys, monkeypatch):
    """A size flag below its bound (from the command line or its SPECDEC_* variable) stops the
    service at once with a usage error naming it (break test: the target used to start and crash
    at warm-up with a traceback)."""
    import importlib

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"{package}.__main__").parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err

