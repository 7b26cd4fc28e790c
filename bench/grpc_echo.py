"""One message exchange on an open bidirectional stream, bare gRPC (no protobuf, no servicer
code): grpc.aio vs sync (thread-per-stream) on each side, TCP loopback vs a unix socket, one run;
and the same exchange without gRPC (``raw``: length-prefixed frames on a plain socket, a blocking
server thread; client blocking ``raw`` or asyncio streams ``aio``) — what any Python transport
without HTTP/2 and gRPC's threads would cost.

  python -m bench.grpc_echo [--exchanges 2000] [--payloads 4096,28000] [--repeat 2]
                            [--pairs aio:aio,sync:aio,aio:sync,sync:sync,raw:raw,raw:aio] [--transports tcp,unix]

The server is its own process echoing each message; the client writes one message and reads
its echo, ``--exchanges`` times on one stream. Prints wall µs per exchange and CPU µs per
exchange of each process (client: this process, all threads; server: /proc, all threads, and
its busiest thread). This is the floor under ``bench.protocol``'s per-round figure (two
exchanges per round) for each API and transport choice. Writes
bench/results/grpc_echo_<tag>.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import queue
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
METHOD = "/echo.Echo/Session"


SINK = "/echo.Echo/Sink"  # aio server only: reads a client stream to its end (bench.protocol --client-writes)


def _handler(fn, sink=None):
    methods = {"Session": grpc.stream_stream_rpc_method_handler(fn)}
    if sink:
        methods["Sink"] = grpc.stream_unary_rpc_method_handler(sink)
    return grpc.method_handlers_generic_handler("echo.Echo", methods)


async def _serve_aio(address: str) -> None:
    async def session(requests, context):
        async for m in requests:
            yield m

    async def sink(requests, context):
        async for _ in requests:
            pass
        return b""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(session, sink),))
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


def _serve_sync(address: str) -> None:
    def session(requests, context):
        yield from requests
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_handler(session),))
    server.add_insecure_port(address)
    server.start()
    server.wait_for_termination()


async def _client_aio(address: str, n: int, payload: int) -> tuple[float, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(METHOD)()
        msg = b"x" * payload
        for _ in range(50):
            await call.write(msg)
            await call.read()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            await call.write(msg)
            await call.read()
        out = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
        await call.done_writing()
        return out


def _serve_raw(address: str) -> None:
    """One connection at a time, echoing 4-byte-length-prefixed frames."""
    import socket

    unix = address.startswith("unix://")
    srv = socket.socket(socket.AF_UNIX if unix else socket.AF_INET)
    if unix:
        srv.bind(address.removeprefix("unix://"))
    else:
        host, port = address.rsplit(":", 1)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, int(port)))
    srv.listen()
    while True:
        conn, _ = srv.accept()
        if not unix:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn, conn.makefile("rb") as f:
            while head := f.read(4):
                conn.sendall(head + f.read(int.from_bytes(head, "little")))


def _raw_open(address: str):
    """A connected blocking socket (retries until the server listens)."""
    import socket

    unix = address.startswith("unix://")
    deadline = time.monotonic() + 30
    while True:
        s = socket.socket(socket.AF_UNIX if unix else socket.AF_INET)
        try:
            if unix:
                s.connect(address.removeprefix("unix://"))
            else:
                host, port = address.rsplit(":", 1)
                s.connect((host, int(port)))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _client_raw(address: str, n: int, payload: int) -> tuple[float, float]:
    s = _raw_open(address)
    frame = payload.to_bytes(4, "little") + b"x" * payload
    with s, s.makefile("rb") as f:
        def exchange():
            s.sendall(frame)
            f.read(4 + payload)
        for _ in range(50):
            exchange()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            exchange()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


async def _client_raw_aio(address: str, n: int, payload: int) -> tuple[float, float]:
    s = _raw_open(address)
    s.setblocking(False)
    reader, writer = await (asyncio.open_unix_connection(sock=s) if address.startswith("unix://")
                            else asyncio.open_connection(sock=s))
    frame = payload.to_bytes(4, "little") + b"x" * payload

    async def exchange():
        writer.write(frame)
        await reader.readexactly(4 + payload)
    for _ in range(50):
        await exchange()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        await exchange()
    out = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    writer.close()
    return out


def _client_sync(address: str, n: int, payload: int) -> tuple[float, float]:
    channel = grpc.insecure_channel(address)
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def messages():
        while (m := outbox.get()) is not None:
            yield m
    replies = channel.stream_stream(METHOD)(messages())
    msg = b"x" * payload
    for _ in range(50):
        outbox.put(msg)
        next(replies)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        outbox.put(msg)
        next(replies)
    out = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    outbox.put(None)
    channel.close()
    return out


def _client(server_api: str, client_api: str, address: str, n: int, payload: int) -> tuple[float, float]:
    """(wall s, client CPU s) per exchange."""
    if server_api == "raw":
        return asyncio.run(_client_raw_aio(address, n, payload)) if client_api == "aio" else _client_raw(address, n, payload)
    return asyncio.run(_client_aio(address, n, payload)) if client_api == "aio" else _client_sync(address, n, payload)


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busiest(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> tuple[str, float]:
    """The thread (name, CPU seconds) that used the most CPU between two ``thread_cpu`` reads."""
    used = [(name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()]
    return max(used, key=lambda nc: nc[1], default=("?", 0.0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exchanges", type=int, default=2000)
    ap.add_argument("--payloads", default="4096,28000", help="bytes per message (28000: 4 feature rows, fp32)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--pairs", default="aio:aio,sync:aio,aio:sync,sync:sync,raw:raw,raw:aio",
                    help="server:client API pairs (raw: no gRPC, see above)")
    ap.add_argument("--transports", default="tcp,unix", help="tcp (127.0.0.1 loopback) and/or unix (a unix socket)")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--serve", nargs=2, metavar=("API", "ADDRESS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        if a.serve[0] == "aio":
            asyncio.run(_serve_aio(a.serve[1]))
        elif a.serve[0] == "raw":
            _serve_raw(a.serve[1])
        else:
            _serve_sync(a.serve[1])
        return 0
    import tempfile

    from bench.protocol import thread_cpu
    from deploy.local import free_port

    results: dict[tuple, list] = {}
    load = [os.getloadavg()[0]]
    sockets = tempfile.mkdtemp(prefix="grpc_echo_")
    for _ in range(a.repeat):
        for payload in [int(p) for p in a.payloads.split(",")]:
            for transport in a.transports.split(","):
                for server_api, client_api in (pair.split(":") for pair in a.pairs.split(",")):
                    address = (f"127.0.0.1:{free_port()}" if transport == "tcp"
                               else f"unix://{sockets}/echo-{len(results)}-{time.monotonic_ns()}.sock")
                    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_echo", "--serve", server_api, address])
                    try:
                        if server_api == "raw":
                            _raw_open(address).close()  # listening
                        else:
                            grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=30)
                        c0, t0 = _cpu_seconds(proc.pid), thread_cpu(proc.pid)
                        wall, client_cpu = _client(server_api, client_api, address, a.exchanges, payload)
                        server_cpu = (_cpu_seconds(proc.pid) - c0) / a.exchanges
                        top, top_cpu = busiest(t0, thread_cpu(proc.pid))
                    finally:
                        proc.terminate()
                        proc.wait(10)
                    r = dict(us_per_exchange=1e6 * wall, client_cpu_us=1e6 * client_cpu, server_cpu_us=1e6 * server_cpu,
                             server_top_thread_cpu_us=1e6 * top_cpu / a.exchanges)
                    results.setdefault((server_api, client_api, transport, payload), []).append(dict(r, top=top))
                    print(json.dumps(dict(server=server_api, client=client_api, transport=transport, payload=payload,
                                          server_top_thread=top, **r)), flush=True)
            load.append(os.getloadavg()[0])
    rows = [dict(server=s, client=c, transport=t, payload=p, server_top_thread=rs[0]["top"],
                 **{k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0] if k != "top"})
            for (s, c, t, p), rs in results.items()]
    meta = dict(host=platform.node(), cpus=os.cpu_count(), python=platform.python_version(), grpc=grpc.__version__,
                exchanges=a.exchanges, repeat=a.repeat, load_average=[round(min(load), 2), round(max(load), 2)],
                when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    table = ("| server | client | transport | payload B | µs / exchange (median of repeats) | client CPU µs | "
             "server CPU µs | server's busiest thread: CPU µs |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(
                 f"| {r['server']} | {r['client']} | {r['transport']} | {r['payload']} | {r['us_per_exchange']:.0f} | "
                 f"{r['client_cpu_us']:.0f} | {r['server_cpu_us']:.0f} | {r['server_top_thread']}: "
                 f"{r['server_top_thread_cpu_us']:.0f} |" for r in rows))
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"grpc_echo_{a.tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (RESULTS / f"grpc_echo_{a.tag}.md").write_text(
        f"# One exchange on an open bidi stream, bare gRPC and raw sockets ({a.tag})\n\n`{json.dumps(meta)}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
