"""python -m deploy.local — start target, draft and orchestrator on loopback (embedded default
model) and, with --prompt, run one real generation and print text, τ and tokens/s.

Each service is its own process, started exactly as ``python -m <service>`` would be. The
workers serve their data channel (``serving.datachannel``: the per-round messages on a Unix
socket in a private temporary directory, ``--data-socket``) and the orchestrator uses it
(``--data-channel auto``); ``--no-data-channel``: everything over gRPC.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2

from specdec_client import probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(address: str) -> int | None:
    """grpc.health.v1 status of ``address`` ("" service), or None if unreachable."""
    status = probe.check(address)
    return None if status == "UNREACHABLE" else health_pb2.HealthCheckResponse.ServingStatus.Value(status)


@dataclass
class Stack:
    """Three running service processes. ``address`` is the orchestrator's."""

    ports: dict[str, int]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    log_dir: str | None = None
    credentials: object = None  # grpc.ChannelCredentials for its own health checks when the services serve TLS
    data_dir: str | None = None  # the workers' data channel sockets (removed by ``stop``)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['orchestrator']}"

    def wait_serving(self, timeout: float = 600.0) -> None:
        """Block until the orchestrator reports SERVING; raises RuntimeError if a process died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; logs in {self.log_dir}")
            if probe.check(self.address, "specdec.v1.Orchestrator", credentials=self.credentials) == "SERVING":
                return
            time.sleep(0.3)
        raise TimeoutError(f"orchestrator not SERVING after {timeout}s")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def start_stack(extra: dict[str, list[str]] | None = None, env: dict | None = None,
                log_dir: str | None = None, data_channel: bool = False) -> Stack:
    """Start the three services on free loopback ports (logs to ``log_dir`` or inherited).
    ``data_channel``: the workers also serve their data channel on Unix sockets in a new
    private temporary directory (``Stack.data_dir``), which the orchestrator then uses."""
    extra = extra or {}
    ports = {n: free_port() for n in ("target", "draft", "orchestrator")}
    cmds = {
        "target": ["-m", "target_service", "--port", str(ports["target"])],
        "draft": ["-m", "draft_service", "--port", str(ports["draft"])],
        "orchestrator": ["-m", "orchestrator", "--port", str(ports["orchestrator"]),
                         "--target", f"127.0.0.1:{ports['target']}", "--draft", f"127.0.0.1:{ports['draft']}"],
    }
    stack = Stack(ports, log_dir=log_dir)
    if data_channel:
        stack.data_dir = tempfile.mkdtemp(prefix="specdec-data-")  # mode 0700
        for name in ("target", "draft"):
            cmds[name] += ["--data-socket", os.path.join(stack.data_dir, f"{name}.sock")]
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    full_env = {"GRPC_VERBOSITY": "ERROR",  # keep gRPC's own plain-text lines out of the JSON logs
                **os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    for name, args in cmds.items():
        out = open(os.path.join(log_dir, f"{name}.log"), "w") if log_dir else None
        stack.procs[name] = subprocess.Popen([sys.executable, *args, *extra.get(name, [])], cwd=ROOT,
                                             env=full_env, stderr=out or None, stdout=out or None)
    return stack


def keep_running(stack: Stack) -> int:
    """Serve until Ctrl-C or a service exits. The draft service may die and come back under its
    supervisor: the orchestrator goes on with one-token rounds (README), so only its exit is
    reported here; the target's or the orchestrator's ends the stack with exit code 1."""
    reported = set()
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            for name, p in stack.procs.items():
                if p.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"{name} exited with {p.returncode}" + ("" if name == "draft" else "; stopping the stack"),
                          flush=True)
                    if name != "draft":
                        return 1
            time.sleep(1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.local", description=__doc__)
    p.add_argument("--prompt", help="run one generation on this chat prompt, print it, then stop")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate for --prompt")
    p.add_argument("--mode", default="tree", choices=["autoregressive", "chain", "tree"],
                   help="speculative mode compared with autoregressive for --prompt (greedy: the token ids must be "
                        "identical; exit status 1 if not)")
    p.add_argument("--budget", type=int, default=0, help="tree budget (0: the server's default)")
    p.add_argument("--log-dir", default=None, help="write service logs here (created if missing) instead of the terminal")
    p.add_argument("--data-channel", action=argparse.BooleanOptionalAction, default=True,
                   help="per-round messages over the workers' data channel (Unix sockets in a temporary directory); "
                        "--no-data-channel: over gRPC")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the services on SIGTERM too
    print("starting target, draft and orchestrator (loading the model: 10 s to a minute on 2 cores; logs: "
          f"{args.log_dir or 'this terminal'})", flush=True)
    stack = start_stack(log_dir=args.log_dir, data_channel=args.data_channel)
    try:
        stack.wait_serving()
        print(f"orchestrator SERVING at {stack.address} (target :{stack.ports['target']}, "
              f"draft :{stack.ports['draft']})", flush=True)
        if not args.prompt:
            return keep_running(stack)
        from specdec_client import SpecDecClient
        from specdec_client.__main__ import stats_line

        outputs = {}
        with SpecDecClient(stack.address) as client:
            for mode in dict.fromkeys(["autoregressive", args.mode]):
                t0 = time.perf_counter()
                r = client.generate(messages=[{"role": "user", "content": args.prompt}],
                                    max_tokens=args.max_tokens, mode=mode, tree_budget=args.budget)
                dt = time.perf_counter() - t0
                outputs[mode] = r.token_ids
                print(f"\n=== {mode}: {stats_line(r, dt)}\n{r.text}", flush=True)
        if args.mode == "autoregressive":
            return 0
        same = outputs[args.mode] == outputs["autoregressive"]
        print(f"\n{args.mode} output identical to autoregressive (token ids): {'yes' if same else 'NO'}", flush=True)
        return 0 if same else 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
