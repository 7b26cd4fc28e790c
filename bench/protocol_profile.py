"""Where a stub round's time goes in the orchestrator: a cProfile of the client and a per-phase
timeline of the round loop (``bench.protocol --profile``).

Both run in the client process of ``bench.protocol`` (the orchestrator: the real round loop and
stream clients), one extra run per variant and budget after the timed ones, so neither touches
the timing table.

- ``cprofile``: ``cProfile`` over the measured requests (not the warm-up), timed by the event
  loop thread's CPU clock: the top functions by cumulative and by own ("tottime") CPU time; the
  stub workers' data-channel sessions too (``install_worker_profiling``: each session's thread
  under its own profiler, merged). The profiler's own cost
  (~1 µs per call) inflates functions that make many small calls; compare budgets, not
  absolute figures.
- ``phases``: timestamps (``time.perf_counter_ns``, the event loop's thread) at the round's
  events, hooked around the stream clients (``orchestrator.workers``) and the bench's consumer:
  ``VW`` / ``DW`` a verify / draft message handed to the socket (data channel; over gRPC when
  the call's ``write`` returns), ``VA`` / ``DA`` its reply's bytes received (data channel only:
  the frame cut in ``data_received``), ``VR`` / ``DR`` ``verify()`` / ``draft()`` returned (reply
  parsed), ``Y`` a delta reached the consumer, ``CW`` its client write completed. Each phase is
  the time from the latest start event to its end event within one request; the table gives
  medians over all rounds in µs. The hooks cost ~1 µs per event.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

#: phase name → (end event, start event); medians over rounds in µs
PHASES = {
    "round (verify sent → next verify sent)": ("VW", "VW"),
    "target: verify sent → reply in": ("VA", "VW"),
    "verify reply in → verify() returns": ("VR", "VA"),
    "verify() returns → draft sent (walk, planner, draft built)": ("DW", "VR"),
    "drafter: draft sent → reply in": ("DA", "DW"),
    "draft reply in → draft() returns": ("DR", "DA"),
    "draft sent → delta at the consumer (push, detokenize)": ("Y", "DW"),
    "client write (delta → written)": ("CW", "Y"),
    "draft() returns → verify sent": ("VW", "DR"),
    "draft reply in → verify sent": ("VW", "DA"),
    "client write done → verify sent": ("VW", "CW"),
    "verify() returns → verify sent": ("VW", "VR"),
}

EVENTS: list[tuple[str, int]] = []  # (event, ns); "REQ" starts a request


def mark(event: str) -> None:
    EVENTS.append((event, time.perf_counter_ns()))


def install_phases() -> None:
    """Hook the stream clients of the tree on the path (``orchestrator.workers``) to ``mark``
    the round's events. Hooks that a tree lacks (an older ``SocketCall``) are skipped."""
    from orchestrator import workers

    target_reply = workers.target_pb2.TargetReply

    def role(call) -> str:
        return "V" if getattr(call, "reply_type", None) is target_reply else "D"

    sc = getattr(workers, "SocketCall", None)
    if sc is not None:
        frame, write = sc.frame, sc.write

        def frame_(self, kind, payload):
            if kind == 2:  # MESSAGE
                mark(role(self) + "A")
            return frame(self, kind, payload)

        async def write_(self, msg):
            await write(self, msg)
            mark(role(self) + "W")
        sc.frame, sc.write = frame_, write_
    else:
        write_ = None
    sessions_exchange = workers._Sessions.exchange

    async def exchange_(self, call, msg, what=""):  # gRPC calls: "written" when handed to write
        if sc is None or not isinstance(call, sc):
            w = call.write

            async def written(m):
                await w(m)
                mark(("V" if isinstance(self, workers.TargetWorker) else "D") + "W")
            try:
                call.write = written
            except AttributeError:  # (a Cython call object: no hook; only returns are marked)
                pass
        return await sessions_exchange(self, call, msg, what)
    workers._Sessions.exchange = exchange_
    for cls, name, ev in ((workers.TargetWorker, "verify", "VR"), (workers.DraftWorker, "draft", "DR")):
        fn = getattr(cls, name)

        def wrap(fn=fn, ev=ev):
            async def hooked(self, *a, **kw):
                out = await fn(self, *a, **kw)
                mark(ev)
                return out
            return hooked
        setattr(cls, name, wrap())


def phase_table(rounds: int) -> dict[str, dict]:
    """{phase: {"median_us", "p90_us", "min_us", "n"}} from ``EVENTS`` (cleared after)."""
    last: dict[str, int] = {}
    spans: dict[str, list[float]] = {p: [] for p in PHASES}
    ends: dict[str, list[str]] = {}
    for p, (end, _) in PHASES.items():
        ends.setdefault(end, []).append(p)
    for ev, t in EVENTS:
        if ev == "REQ":
            last.clear()
            continue
        for p in ends.get(ev, ()):
            start = PHASES[p][1]
            if start in last:
                spans[p].append((t - last[start]) / 1000)
        last[ev] = t
    EVENTS.clear()
    out = {}
    for p, xs in spans.items():
        if xs:
            xs.sort()
            out[p] = dict(median_us=round(statistics.median(xs), 1), p90_us=round(xs[int(0.9 * (len(xs) - 1))], 1),
                          min_us=round(xs[0], 1), n=len(xs))
    return out


def start_cprofile() -> cProfile.Profile:
    """A running profiler timed by this thread's CPU clock (the event loop's thread: time blocked
    in ``epoll`` or descheduled does not count; CPU is what differs between budgets)."""
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    return prof


def cprofile_text(prof: cProfile.Profile, rounds: int, top: int = 30) -> dict[str, str]:
    """{"cumulative": table, "tottime": table}: the ``top`` functions by each key, as pstats
    prints them (file basenames), headed by the total and the rounds they cover."""
    prof.disable()
    out = {}
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key)
        print(f"{rounds} rounds; main thread CPU {1e6 * st.total_tt / max(1, rounds):.1f} µs per round (profiled)",
              file=s)
        st.print_stats(top)
        out[key] = "\n".join(line.rstrip() for line in s.getvalue().splitlines() if line.strip())
    return out


def markdown(results: list[dict]) -> str:
    """The profile file's body: per variant and budget, the phase medians side by side, then the
    cProfile tables."""
    text = []
    phased = [r for r in results if r.get("phases")]
    if phased:
        cols = [f"{r['protocol']} @{r['tree_budget']}" for r in phased]
        text.append("## Round phases (µs, median over rounds; p90 in parentheses)\n")
        text.append("| phase | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
        for p in PHASES:
            cells = [f"{r['phases'][p]['median_us']:.1f} ({r['phases'][p]['p90_us']:.0f})" if p in r["phases"] else "–"
                     for r in phased]
            text.append(f"| {p} | " + " | ".join(cells) + " |")
        text.append("")
    for r in results:
        if r.get("cprofile"):
            for key, table in r["cprofile"].items():
                text.append(f"## cProfile of the orchestrator: {r['protocol']}, budget {r['tree_budget']}, by {key}\n")
                text.append("```\n" + table + "\n```\n")
        for role, tables in (r.get("worker_cprofile") or {}).items():
            for key, table in tables.items():
                text.append(f"## cProfile of the {role} worker's data-channel sessions: {r['protocol']}, budget "
                            f"{r['tree_budget']}, by {key}\n")
                text.append("```\n" + (table or "(no data-channel session)") + "\n```\n")
    return "\n".join(text)


# ---- the stub workers' data-channel sessions (``--profile``'s cProfile run profiles them too)

WORKER: dict = {"on": False, "profiles": []}


def install_worker_profiling(out_file: str) -> None:
    """In a stub worker process: each SIGUSR2 toggles profiling of the data-channel sessions
    that start meanwhile (``DataChannel._session`` under a per-thread ``cProfile`` timed by the
    thread's CPU clock); the second writes their merged top functions to ``out_file`` (JSON:
    {"cumulative": table, "tottime": table}). Sessions over gRPC are not profiled."""
    import json
    import signal
    import threading

    from serving.datachannel import DataChannel

    lock, session = threading.Lock(), DataChannel._session

    def profiled(self, conn, context, *rpc):
        if not WORKER["on"]:
            return session(self, conn, context, *rpc)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        try:
            return session(self, conn, context, *rpc)
        finally:
            prof.disable()
            with lock:
                WORKER["profiles"].append(prof)
    DataChannel._session = profiled

    def toggle(*_):
        if not WORKER["on"]:
            WORKER["on"], WORKER["profiles"] = True, []
            return
        WORKER["on"] = False
        with lock:
            profs = list(WORKER["profiles"])
        tables = {}
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            if profs:
                st = pstats.Stats(*profs, stream=s).strip_dirs().sort_stats(key)
                print(f"{len(profs)} sessions; their threads' CPU {st.total_tt * 1e3:.1f} ms (profiled)", file=s)
                st.print_stats(25)
            tables[key] = "\n".join(line.rstrip() for line in s.getvalue().splitlines() if line.strip())
        with open(out_file, "w") as f:
            json.dump(tables, f)
    signal.signal(signal.SIGUSR2, toggle)


def worker_profile_file(pid: int) -> str:
    return f"/tmp/bench_protocol_wprof_{pid}.json"


def toggle_workers(pids: dict, read: bool = False) -> dict:
    """SIGUSR2 to each stub worker ({role: pid}); with ``read``, wait for and return their
    tables ({role: {"cumulative", "tottime"}}), removing the files."""
    import json
    import os
    import signal
    out = {}
    for role, pid in pids.items():
        path = worker_profile_file(pid)
        if read and os.path.exists(path):
            os.unlink(path)
        os.kill(pid, signal.SIGUSR2)
        if not read:
            continue
        for _ in range(300):
            if os.path.exists(path):
                try:
                    out[role] = json.load(open(path))
                    os.unlink(path)
                    break
                except ValueError:  # (being written)
                    pass
            time.sleep(0.01)
    return out
