"""Several orchestrator processes behind one port: ``python -m orchestrator --processes N``.

Why (issue 14, plans/0009 "Session 21"): the orchestrator is one Python process, and every
round of every request costs it ~0.2–0.5 ms of CPU (the acceptance walk, detokenisation, the
client write, the two worker messages). At 64 live requests that serial work, not the GPU, sets
the step time (H200: a round every ~32 ms per request at c = 64 while the workers batch only ~14
of the 64 per verify). Requests are independent, so N processes do N times the orchestrator's
rounds (measured on the H200: +9–27 % for speculative configurations at c = 16–64, autoregressive
unchanged — the workers' per-message Python is the next bound; plans/0009 "Session 21").

How: this process becomes a supervisor. It reserves the port (``reserve_port``; a free one for
port 0), then starts N copies of the same command (``--processes 1 --port P --metrics-port 0``
appended: argparse keeps an option's last value) with ``SPECDEC_SHARD=i/N`` — which makes
``serving.server.ServiceHost`` bind with SO_REUSEPORT, so the kernel spreads new client
connections over the N listeners (per connection: one client connection's streams all go to one
shard; many clients, or a channel per stream, spread). Each shard is a whole orchestrator (its
own worker links, planner, health, drain), so a connection answered by any shard is served as
by a single orchestrator; the workers batch the rounds of all shards together.

Metrics: the shards write prometheus-client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``,
a temporary directory of the supervisor's) and the supervisor serves their sum on
``--metrics-port`` (counters and histograms summed; ``specdec:num_requests_running`` summed over
live shards; the τ and plan-rate gauges one series per shard, labelled ``pid``).

Signals: SIGTERM / SIGINT are passed to every shard, which drains (``--drain-seconds``); the
supervisor exits 0 when all exited 0. A shard that exits on its own ends the others (SIGTERM)
and the supervisor exits 1 — a process manager restarts the whole (a smaller orchestrator
would silently serve with fewer shards). Each shard gets SIGTERM if the supervisor dies
(``PR_SET_PDEATHSIG``). Linux only (SO_REUSEPORT's balancing, prctl).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SHARD_ENV = "SPECDEC_SHARD"
_PR_SET_PDEATHSIG = 1


def shard() -> tuple[int, int] | None:
    """(index, count) of this process when a supervisor started it (``SPECDEC_SHARD=i/N``), else None."""
    try:
        i, n = os.environ.get(SHARD_ENV, "").split("/")
        return int(i), int(n)
    except ValueError:  # unset, or not "i/N" (only a supervisor sets it): not a shard
        return None


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold the port the shards will share: ``port`` if nobody holds it, or a free one for port 0
    (OSError naming ``--host`` / ``--port`` otherwise). Probed by a bind without SO_REUSEPORT (a
    port any other socket holds fails it), then held by a bound, not listening, SO_REUSEPORT socket
    for the supervisor's life: the shards (same user, SO_REUSEPORT) join it, another supervisor's
    probe — or any process binding without SO_REUSEPORT — fails. Not SO_REUSEADDR (another
    supervisor's probe could then bind beside it before the shards listen), so connections in
    TIME_WAIT from an orchestrator that used the port without SO_REUSEPORT (``--processes 1``) hold
    it for up to a minute after that one stopped. Returns the held socket."""
    addr = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # "[::1]": gRPC's IPv6 form
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((addr, port), family=family) as probe:
            port = probe.getsockname()[1]
        held = socket.socket(family, socket.SOCK_STREAM)
        try:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            held.bind((addr, port))
        except OSError:
            held.close()
            raise
        return held
    except OSError as e:
        raise OSError(f"--host {host} --port {port}: {e.strerror or e}") from None


class _Only:
    """The families named ``names`` of ``collector`` (the shards' files also hold families that
    every importer of ``serving.metrics`` creates, e.g. the target's KV gauges)."""

    def __init__(self, collector, names):
        self.collector, self.names = collector, frozenset(names)

    def collect(self):
        return [m for m in self.collector.collect() if m.name in self.names]


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the supervisor dies
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(module: str, argv: list[str], processes: int, host: str, port: int, metrics_port: int,
              drain_seconds: float, log, metric_names=()) -> int:
    """Run ``python -m module argv… --processes 1 --port P --metrics-port 0`` ``processes``
    times on one port (see the module docstring) until SIGTERM / SIGINT or a shard's exit;
    ``metric_names``: the families /metrics serves. Returns the exit status: 0 when every shard
    drained and exited 0, 1 otherwise (also when the port or the metrics port is taken: logged,
    nothing started)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    try:
        held = reserve_port(host, port)
    except OSError as e:
        log.error(str(e))
        return 1
    if metrics_port:  # checked before any shard starts; served once they run
        try:
            with socket.create_server(("0.0.0.0", metrics_port)):
                pass
        except OSError as e:
            held.close()
            log.error(f"--metrics-port {metrics_port}: {e.strerror or e}")
            return 1
    port = held.getsockname()[1]
    env = {**os.environ}
    metrics_dir = tempfile.mkdtemp(prefix="specdec-metrics-") if metrics_port else None
    if metrics_dir:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    cmd = [sys.executable, "-m", module, *argv, "--processes", "1", "--port", str(port), "--metrics-port", "0"]
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, _: stopping.append(sig))
    procs = [subprocess.Popen(cmd, env={**env, SHARD_ENV: f"{i}/{processes}"}, preexec_fn=_die_with_parent)
             for i in range(processes)]
    log.info("shards started", port=port, processes=processes, pids=[p.pid for p in procs])
    status, forwarded = 0, None
    try:
        if metrics_dir:
            registry = CollectorRegistry()
            registry.register(_Only(MultiProcessCollector(None, path=metrics_dir), metric_names))
            start_http_server(metrics_port, registry=registry)
        while alive := [p for p in procs if p.poll() is None]:
            if forwarded is None and (stopping or len(alive) < len(procs)):
                if not stopping:  # a shard ended on its own
                    gone = next(p for p in procs if p.returncode is not None)
                    log.error("a shard exited; stopping the others", pid=gone.pid, code=gone.returncode)
                    status = 1
                forwarded = time.monotonic()
                for p in alive:
                    p.send_signal(stopping[0] if stopping else signal.SIGTERM)
            elif forwarded is not None and time.monotonic() > forwarded + drain_seconds + 30.0:
                log.error("shards still running past the drain; killed", pids=[p.pid for p in alive])
                status = 1
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        held.close()
    codes = [p.returncode for p in procs]
    log.info("shards stopped", codes=codes)
    return 1 if status or any(codes) else 0
