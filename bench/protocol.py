"""Per-round protocol cost with stub workers (no model): v1 vs v2, and v2 of other checkouts, one run.

  python -m bench.protocol [--requests 8] [--rounds 64] [--budgets 4,64] [--repeat 3]
                           [--baseline DIR[=LABEL]]... [--knobs JSON]... [--baseline-knobs] [--tokenizer PATH]
                           [--client-writes] [--concurrency 1] [--step-ms V,D] [--client-python PATH]
                           [--text] [--feature-dtype auto|float32|bfloat16] [--profile]

Every variant runs its two stub workers and its client in their own processes, with the
variant's code tree first on PYTHONPATH (``--baseline``: e.g. ``git archive <commit> | tar -x -C
DIR``, the code before a change) and this file's stubs: engines that answer at once, so the time
is wire + serialisation + orchestration only. A stub round accepts 3 drafts (τ = 4); features
are zeros of the real width (3 taps × 576, float32: 6.9 KB per row).
- v1: specdec.v1 as it was served until plans/0004 — two unary calls per round (Draft,
  Verify); the target walks and commits inside Verify; the orchestrator decodes and re-encodes
  the features with torch; the same OutputStream handling as the real loop.
- v2: specdec.v2 — the real servicers (``target_service.servicer``, ``draft_service.servicer``)
  over stub engines and the real round loop (``orchestrator.generation.generate``) with the
  real stream clients (``orchestrator.workers``): one message each way per worker per round on
  an open stream, the walk in the orchestrator.
- ``--knobs``: v2 again with extra gRPC channel/server args, a GIL switch interval, the
  workers on unix sockets instead of TCP loopback (``{"unix": true}``), or the Session streams
  over the workers' data channel (``{"data_channel": true}``: ``serving.datachannel``, frames on
  a Unix socket; gRPC only for the drafter's GetInfo; ``{"data_channel": "streams"}``: its client
  on asyncio streams instead of a Protocol); ``{"step_ms": [V, D]}``: every stub verify / draft
  engine call sleeps V / D ms (GIL released), as a device step takes time, so that under
  ``--concurrency`` messages queue in the workers' batchers as on a GPU and the orchestrator is
  the only busy process; ``{"text": true}`` (``--text``: on every variant): the stub rounds emit
  ordinary tokens (text for the orchestrator to detokenize) instead of control tokens;
  ``{"steps": true}``: the round loop's clients exchange over the workers' ``Steps`` streams
  (``orchestrator.steps``, as ``--steps on``; with ``data_channel``, on the data channel too);
  ``{"rounds": "one-token"}``: tree-mode requests whose every round verifies the bonus alone (what
  the adaptive planner's one-token rounds cost: feature rows still returned and kept);
  ``{"rounds": "autoregressive"}``: autoregressive requests (no feature rows); both as many rounds;
  ``{"rounds": "adaptive"}``: the tree budget is the cap of an adaptive policy planned on ``H200_COSTS``;
  ``{"planner": {...}}``: keyword arguments of the process's ``BudgetPlanner`` (``{"learn": false}``: no
  measured round times, so no trials);
  ``{"feature_dtype": "bfloat16"}`` (``--feature-dtype``: on every variant): the stub target's
  feature rows in bf16 (3.5 KB a row, as the GPU workers send them) instead of float32 (6.9 KB, as
  the CPU workers send them); ``--feature-dtype auto`` (default): the workers' own default dtype
  on this host — bf16 where CUDA is available (the GPU deployment), float32 elsewhere.
  Busy-polling (``SPECDEC_SPIN_US``, ``serving.datachannel.spin_settings``) is each process's
  default unless a knob sets it (``{"env": {"SPECDEC_SPIN_US": "0"}}``: off): unset, it is on for
  hosts with ≥ 8 CPUs; the results' meta records what unset means here (``busy_poll``).
  ``--baseline-knobs``: each knob variant on every ``--baseline`` tree too (the tree's own code
  for everything but the stubs).
- ``--client-writes``: the client writes each delta to a gRPC stream (``bench.grpc_echo``'s aio
  server reads it), awaiting each send as the orchestrator's servicer awaits each chunk's send
  to its client; without it the deltas are dropped.
``--concurrency C``: C requests at a time on the client's one event loop (as the orchestrator
serves concurrent streams; v2 requests share one round-shape planner and one draft-health view
with the orchestrator's 2 s draft deadline, as the served process does); rounds / s over all of
them and the stub workers' mean batch (requests per engine call, counted in the stubs) then show
the orchestrator under load. ``--client-python``: the client's interpreter (the round loop starts
its draft task eagerly on Python >= 3.12, as on the H200 host; this VM's default is 3.11).
Per-round ms = (request wall time − its first exchange) / rounds, median over requests; CPU ms
per round of each process (utime + stime of all its threads over the measured requests; the
client's includes each request's stream set-up), and split by thread: the main thread, gRPC's
``event_engine`` threads, the rest (the sync server's handler threads, gRPC's pollers).
Variants are measured in turn ``--repeat`` times (interleaved, so a load change hits all
alike); the tables give medians over repeats.
Writes bench/results/protocol_<tag>.{json,md} (tag: cpu or gpu unless ``--tag``); with
``--profile`` also protocol_profile_<tag>.{json,md} (``bench.protocol_profile``: the round's
phase timeline and a cProfile of the orchestrator, per variant and budget, from extra runs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
WIDTH = 3 * 576
DEPTH = 3  # drafts a stub round accepts


def stub_tree(bonus: int, budget: int) -> tuple[list[int], list[int]]:
    """A chain of DEPTH+1 drafts (tokens bonus+1, bonus+2, …) plus siblings of the first up to
    the budget (node i > chain: token 50,000 + i, parent 0). Built by whole-list operations
    (2.3 µs at budget 64; a per-node loop took 4.9), as a stub engine should answer at once."""
    chain = min(budget, DEPTH + 1)
    tokens, parents = [bonus, *range(bonus + 1, bonus + chain + 1)], [-1, *range(chain)]
    if budget > chain:
        tokens += range(50_001 + chain, 50_001 + budget)
        parents += [0] * (budget - chain)
    return tokens, parents


def stub_samples(tokens: list[int]) -> list[int]:
    """Samples that accept the first DEPTH chain nodes of ``stub_tree``; the bonus is 7 (a
    control token: no text), or with knob ``text`` the next ordinary token (ids from 1000 up:
    every emitted token is text to detokenize, as in a real output)."""
    bonus = tokens[0]
    nxt = 1000 + (bonus + DEPTH + 1 - 1000) % 30_000 if TEXT_TOKENS else 7
    return ([bonus + i + 1 for i in range(DEPTH)] + [nxt] * (len(tokens) - DEPTH))[:len(tokens)]


TEXT_TOKENS = False  # knob ``text``
PLANNER: dict = {}  # knob ``planner``: keyword arguments of the client's BudgetPlanner (e.g. {"learn": false})
ROUNDS = ""  # knob ``rounds``: "one-token" (tree-mode requests verifying their bonus alone) or "autoregressive"
STEPS = False  # knob ``steps``: the round loop exchanges over Steps streams (orchestrator --steps on)
FEATURE_DTYPE = "float32"  # knob ``feature_dtype`` (--feature-dtype): the stub target's feature rows


def _features(rows: int):
    """Zero feature rows [rows, WIDTH] in ``FEATURE_DTYPE`` (float32: 6.9 KB a row, as the CPU workers send;
    bfloat16: 3.5 KB, as the GPU workers send in their default dtype)."""
    import torch
    return torch.zeros(rows, WIDTH, dtype=getattr(torch, FEATURE_DTYPE))
MARK = None  # ``--profile``'s phase run: ``bench.protocol_profile.mark`` (events of the consumer)


def _profiler():
    """``bench/protocol_profile.py`` beside this file (a ``--baseline`` tree on the path may lack it)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_protocol_profile",
                                                  pathlib.Path(__file__).with_name("protocol_profile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- stub engines (duck-typed like the real ones)

class StubTarget:
    """TargetEngine API (v2), no model."""
    max_tree_budget, max_context, kv_pool_tokens, taps, reserved_tokens, live_requests = 512, 8192, 1 << 20, (1, 2, 3), 0, 0

    def __init__(self):
        self.plain = set()  # autoregressive requests: no feature rows, as the real engine
        self.held = {}  # rid → feature rows its held verifies kept (returned by the next one that does not hold)

    def prefill(self, rid, prompt, max_new, params, mode="autoregressive", tree_budget=0, wait_seconds=None,
                hold=False):
        from protocol.types import Prefilled
        if mode == "autoregressive":
            self.plain.add(rid)
            return Prefilled(1, None)
        self.plain.discard(rid)
        if hold:
            self.held[rid] = len(prompt)
            return Prefilled(1, None)
        self.held.pop(rid, None)
        return Prefilled(1, _features(len(prompt)))

    def verify(self, rid, tokens, parents, commit=None, hold=False):
        _step("verify", 1)
        return self._verify(rid, tokens, parents, commit, hold)

    def _verify(self, rid, tokens, parents, commit=None, hold=False):
        import torch

        from modeling import acceptance
        from protocol.types import Verified
        samples = stub_samples(tokens)
        if rid in self.plain:
            return Verified(samples, [1.0], [], None)
        path, _ = acceptance.resolve(tokens, parents, samples)
        if hold:
            self.held[rid] = self.held.get(rid, 0) + len(path)
            return Verified(samples, [1.0] * len(tokens), path, None)
        held = self.held.pop(rid, 0)
        return Verified(samples, [1.0] * len(tokens), path, _features(held + len(path)), held)

    def verify_batch(self, items):
        _step("verify", len(items))
        return [self._verify(i.request_id, i.tokens, i.parents, i.commit, i.hold) for i in items]

    def release(self, ids):
        for rid in ids:
            self.held.pop(rid, None)
            self.plain.discard(rid)
        return len(ids)


class StubDraft:
    max_context, max_tree_budget, live_requests, name, device = 8192, 512, 0, "stub", "cpu"
    cfg = __import__("types").SimpleNamespace(block_size=16, target_layer_ids=(1, 2, 3), hidden_size=576,
                                              vocab_size=49152, mask_token_id=16)

    def __init__(self):
        self.budget = {}

    def draft(self, rid, features, start, bonus, mode=None, budget=None):
        _step("draft", 1)
        return self._draft(rid, bonus, mode, budget)

    def _draft(self, rid, bonus, mode, budget):
        if mode is not None:
            self.budget[rid] = budget
        return stub_tree(bonus, self.budget[rid])

    def holds(self, rid) -> bool:
        return rid in self.budget

    def draft_batch(self, items):
        _step("draft", len(items))
        return [self._draft(i.request_id, i.bonus, i.mode, i.budget) for i in items]

    def release(self, ids):
        return len(ids)


#: knob ``step_ms``: [verify, draft] ms each engine call sleeps (GIL released), as a GPU step
#: takes time whatever the host does: messages then queue in the workers' batchers as on a device
STEP_MS = {"verify": 0.0, "draft": 0.0}
BATCHES = {"verify": [0, 0], "draft": [0, 0]}  # engine calls, requests in them


def _step(kind: str, n: int) -> None:
    BATCHES[kind][0] += 1
    BATCHES[kind][1] += n
    if STEP_MS[kind]:
        time.sleep(STEP_MS[kind] / 1000)


def _batch_file(pid: int) -> pathlib.Path:
    return pathlib.Path(f"/tmp/bench_protocol_batches_{pid}.json")


def _batches(pids: dict) -> dict:
    """{role: {kind: [calls, requests]}} of the stub workers so far (each writes its counts on SIGUSR1)."""
    import signal
    out = {}
    for role, pid in pids.items():
        _batch_file(pid).unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)
        for _ in range(200):
            if _batch_file(pid).exists():
                try:
                    out[role] = json.loads(_batch_file(pid).read_text())
                    _batch_file(pid).unlink(missing_ok=True)
                    break
                except ValueError:  # (written meanwhile)
                    pass
            time.sleep(0.01)
    return out


# ---- servers (run in their own processes)

SERVICES = {"target": "specdec.v2.TargetService", "draft": "specdec.v2.DraftService"}


async def serve(version: str, role: str, address: str, data_socket: str = "") -> None:
    """``data_socket``: also serve the Session stream on this Unix socket (``serving.datachannel``)."""
    import torch

    from serving.logs import configure
    from serving.server import ServiceHost
    # one intra-op thread, as the real workers run (``--threads 1``): with torch's default (a thread
    # per core) the stub prefill's zeros fill is an OpenMP region whose team then spin-waits
    # (~5 ms per thread per region): 3.3 ms of "target CPU per round" on a 32-core host, none of it protocol
    torch.set_num_threads(1)
    configure(f"stub-{role}", "WARNING")
    import signal
    signal.signal(signal.SIGUSR1, lambda *_: _batch_file(os.getpid()).write_text(json.dumps(BATCHES)))
    if version == "v2" and data_socket:  # (``--profile``: SIGUSR2 toggles profiling of the data-channel sessions)
        prof = _profiler()
        prof.install_worker_profiling(prof.worker_profile_file(os.getpid()))
    # v1 on grpc.aio, as it was served (its handlers are coroutines); v2 as the tree's host picks
    host = ServiceHost([SERVICES[role]], 64, **({} if version == "v2" else {"threads": 0}))
    if version == "v2":
        ref = {"engine": StubTarget() if role == "target" else StubDraft()}
        if role == "target":
            from specdec_proto.v2 import target_pb2, target_pb2_grpc
            from target_service.servicer import TargetServicer
            servicer = TargetServicer(host, ref)
            target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, host.server)
            ref["session"], ref["steps"] = (servicer, target_pb2.TargetMessage), target_pb2.TargetStep
        else:
            from draft_service.servicer import DraftServicer
            from specdec_proto.v2 import draft_pb2, draft_pb2_grpc
            servicer = DraftServicer(host, ref)
            draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, host.server)
            ref["session"], ref["steps"] = (servicer, draft_pb2.DraftMessage), draft_pb2.DraftStep
        if data_socket:
            from types import SimpleNamespace

            from serving.datachannel import serve_data_channel
            serve_data_channel(SimpleNamespace(data_socket=data_socket), host, ref)
    else:
        _add_v1(role, host)
    await host.start(address)
    await host.set_status(True)
    await asyncio.Event().wait()


def _add_v1(role: str, host) -> None:
    """specdec.v1 worker servicers as they were: unary calls, accept + commit inside Verify."""
    import torch

    from modeling import acceptance
    from protocol.wire import tensor_from_proto, tensor_to_proto
    from specdec_proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    class Target(target_pb2_grpc.TargetServiceServicer):
        async def Prefill(self, request, context):
            it = request.items[0]
            feats = tensor_to_proto(torch.zeros(len(it.prompt_tokens), WIDTH))
            return target_pb2.PrefillResponse(results=[target_pb2.PrefillResult(
                request_id=it.request_id, first_token=1, context_features=feats)])

        async def Verify(self, request, context):
            it = request.items[0]
            tokens, parents = list(it.tree.tokens), list(it.tree.parents)
            samples = stub_samples(tokens)
            path, bonus = acceptance.resolve(tokens, parents, samples)
            return target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(
                request_id=it.request_id, accepted_nodes=path, bonus_token=bonus, node_samples=samples,
                expected_accepted=float(len(path) - 1), context_features=tensor_to_proto(torch.zeros(len(path), WIDTH)))])

        async def Release(self, request, context):
            return common_pb2.ReleaseResponse(released=len(request.request_ids))

    class Draft(draft_pb2_grpc.DraftServiceServicer):
        async def Draft(self, request, context):
            it = request.items[0]
            tensor_from_proto(it.context_features)
            tokens, parents = stub_tree(it.bonus_token, it.budget)
            return draft_pb2.DraftResponse(results=[draft_pb2.DraftResult(
                request_id=it.request_id, tree=common_pb2.TokenTree(tokens=tokens, parents=parents))])

        async def Release(self, request, context):
            return common_pb2.ReleaseResponse(released=len(request.request_ids))

    if role == "target":
        target_pb2_grpc.add_TargetServiceServicer_to_server(Target(), host.server)
    else:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(Draft(), host.server)


# ---- clients

async def open_v1(addresses) -> tuple:
    """The v1 channels and stubs, kept for all of a client's requests (as an orchestrator keeps them)."""
    import grpc

    from serving.server import channel_options
    from specdec_proto.v1 import draft_pb2_grpc, target_pb2_grpc

    opts = channel_options(64)
    tc = grpc.aio.insecure_channel(addresses["target"], options=opts)
    dc = grpc.aio.insecure_channel(addresses["draft"], options=opts)
    return (tc, dc), (target_pb2_grpc.TargetServiceStub(tc), draft_pb2_grpc.DraftServiceStub(dc))


async def run_v1(links, tok, prompt, rounds, budget, sink=None) -> tuple[float, int]:
    """The v1 round loop as it was: Prefill; per round Draft (features decoded and re-encoded
    by the orchestrator) + Verify; tokens pushed through OutputStream. Returns (s per round, rounds).
    (No client writes: ``sink`` is ignored.)"""
    from orchestrator.stopping import OutputStream
    from protocol.types import SamplingParams
    from protocol.wire import sampling_to_proto, tensor_from_proto, tensor_to_proto
    from specdec_proto.v1 import common_pb2, draft_pb2, target_pb2

    ts, ds = links
    sp = sampling_to_proto(SamplingParams())
    out = OutputStream(tok, [], set(), 10 ** 6)
    r = (await ts.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
        request_id="b", prompt_tokens=prompt, max_new_tokens=rounds * 8, sampling=sp, return_features=True)]))).results[0]
    feats, bonus, start = tensor_from_proto(r.context_features), r.first_token, 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        d = (await ds.Draft(draft_pb2.DraftRequest(items=[draft_pb2.DraftItem(
            request_id="b", context_features=tensor_to_proto(feats), context_start=start, bonus_token=bonus,
            mode=draft_pb2.TREE_MODE_TREE, budget=budget)]))).results[0]
        start += feats.shape[0]
        tokens, parents = list(d.tree.tokens), list(d.tree.parents)
        v = (await ts.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
            request_id="b", tree=common_pb2.TokenTree(tokens=tokens, parents=parents), sampling=sp,
            return_features=True)]))).results[0]
        feats, bonus = tensor_from_proto(v.context_features), v.bonus_token
        for t in [tokens[i] for i in v.accepted_nodes[1:]] + [bonus]:
            out.push(t % 49152)
        out.take_delta()
    dt = time.perf_counter() - t0
    await ts.Release(common_pb2.ReleaseRequest(request_ids=["b"]))
    await ds.Release(common_pb2.ReleaseRequest(request_ids=["b"]))
    return dt / rounds, rounds


async def open_v2(addresses) -> tuple:
    """The real stream clients, kept for all of a client's requests (as the orchestrator keeps them)."""
    from orchestrator.workers import DraftWorker, TargetWorker

    target, draft = TargetWorker(addresses["target"], steps=STEPS), DraftWorker(addresses["draft"], steps=STEPS)
    await draft.info()
    if addresses.get("target_data"):  # (the data_channel knob; the stub target has no GetInfo)
        target.choose_channel(addresses["target_data"])
        draft.choose_channel(addresses["draft_data"])
    return (target.channel, draft.channel), (target, draft)


async def run_v2(links, tok, prompt, rounds, budget, sink=None, shared=None) -> tuple[float, int]:
    """The real loop and stream clients; the first yield ends the prefill exchange. ``sink``: a
    channel to ``bench.grpc_echo``'s server; each delta is written to a stream on it, awaited as
    the orchestrator's servicer awaits each chunk's send to its client."""
    from orchestrator.generation import Delta, GenerationRequest, generate

    target, draft = links
    out = sink.stream_unary("/echo.Echo/Sink")() if sink else None  # (bench.grpc_echo.SINK; a baseline tree may lack it)
    # DEPTH + 1 tokens per round; the first token comes from the prefill
    req = (GenerationRequest("b", prompt, 1 + rounds * (DEPTH + 1), mode="tree", tree_budget=budget,
                             budget_policy="adaptive" if ROUNDS == "adaptive" else "fixed") if ROUNDS in ("", "adaptive")
           else GenerationRequest("b", prompt, 1 + rounds, mode="autoregressive" if ROUNDS == "autoregressive" else "tree",
                                  tree_budget=budget))
    t0, n = None, 0
    if MARK:
        MARK("REQ")
    async for ev in generate(req, tok, target, draft, **(shared or {})):
        if isinstance(ev, Delta):
            t0 = t0 or time.perf_counter()
            if MARK:
                MARK("Y")
            if out:
                await out.write(ev.text.encode() or b"-")
                if MARK:
                    MARK("CW")
        else:
            n = ev.stats.rounds
    if out:
        await out.done_writing()
        await out
    return (time.perf_counter() - t0) / n, n


# ---- processes: every variant runs its two servers and its client in their own processes, with
# ``tree`` (a checkout of this repository, e.g. the code before a change) first on the path

def _child(tree: str, *args: str, python: str = "") -> list[str]:
    """argv running this file's ``main(args)`` with ``tree``'s packages (servicers, round loop),
    under ``python`` (default: this interpreter)."""
    code = f"import runpy, sys; sys.argv = {[__file__, *args]!r}; runpy.run_path({__file__!r}, run_name='__main__')"
    return [python or sys.executable, "-c", code]


def _env(tree: str) -> dict:
    return {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _tune(knobs: dict) -> None:
    """Apply a variant's knobs in this process: extra gRPC channel/server args, GIL switch
    interval, ``writer_task``: the round loop's stream clients hand each message to gRPC's own
    writer task (the call's request iterator) and wait only for the reply, not for the write's
    completion (a candidate for hosts with idle cores; it costs CPU on a busy one: plans/0004)."""
    os.environ.update(knobs.get("env", {}))  # e.g. {"SPECDEC_DRAFT_OVERLAP_MAX_LIVE": "0"}, before the loop is imported
    global TEXT_TOKENS, FEATURE_DTYPE, STEPS, ROUNDS, PLANNER
    TEXT_TOKENS, STEPS, ROUNDS = bool(knobs.get("text")), bool(knobs.get("steps")), knobs.get("rounds", "")
    PLANNER = knobs.get("planner", {})
    FEATURE_DTYPE = knobs.get("feature_dtype", "float32")
    if knobs.get("step_ms"):
        STEP_MS["verify"], STEP_MS["draft"] = knobs["step_ms"]
    if knobs.get("switch_interval"):
        sys.setswitchinterval(knobs["switch_interval"])
    if knobs.get("writer_task"):
        _writer_task_clients()
    if knobs.get("data_channel") == "streams":
        _streams_clients()
    extra = [tuple(a) for a in knobs.get("grpc_args", [])]
    if extra:
        import serving.server as server
        base = server.channel_options
        server.channel_options = lambda mb: base(mb) + extra
        try:
            import orchestrator.workers as workers
            workers.channel_options = server.channel_options
        except ImportError:
            pass


def _one_token_planner():
    from orchestrator.adaptive import BudgetPlanner
    from orchestrator.budget import ONE_TOKEN

    class OneToken(BudgetPlanner):
        """Every round one-token (knob ``rounds``: "one-token"), the planner's bookkeeping kept."""
        def next_shape(self, t):
            super().next_shape(t)
            return ONE_TOKEN

        def holds(self, t):  # (a one-token plan: the rows stay with the target)
            return True
    return OneToken


def _streams_clients() -> None:
    """Knob ``{"data_channel": "streams"}``: the data channel's client on asyncio streams
    (``open_unix_connection``, ``readexactly`` per frame) instead of ``orchestrator.workers``'s
    ``asyncio.Protocol`` — the alternative weighed in plans/0004 "Session 6"."""
    import grpc

    from orchestrator import workers
    from serving import datachannel as dc

    class StreamsCall(workers.SocketCall):
        async def write(self, msg):
            if self.status is not None:
                raise self.error()
            payload = msg.SerializeToString()
            if self.transport is None:
                self.reader, self.writer = await asyncio.open_unix_connection(self.path)
                self.transport = self.writer.transport
                self.writer.write(self.open_frame + dc.frame(dc.MESSAGE, payload))
            else:
                self.writer.write(dc.frame(dc.MESSAGE, payload))

        async def read(self):
            if self.status is not None:
                return grpc.aio.EOF if self.status[0] == grpc.StatusCode.OK else self._raise()
            try:
                n, kind = dc.HEADER.unpack(await self.reader.readexactly(dc.HEADER.size))
                payload = await self.reader.readexactly(n)
            except (asyncio.IncompleteReadError, OSError):
                self.lost(None)
                return self._raise()
            if kind == dc.MESSAGE:
                return self.reply_type.FromString(payload)
            self.frame(kind, payload)
            return await self.read()

        def _raise(self):
            raise self.error()

        async def code(self):
            if self.transport is not None and not self.closed.done():
                await self.reader.read()  # the worker's close
                self.lost(None)
            return await super().code()

    workers.SocketCall = StreamsCall


def _writer_task_clients() -> None:
    import grpc

    from orchestrator import workers

    def open_(self, worker_id, timeout=None):
        outbox = asyncio.Queue()

        async def messages():
            while (m := await outbox.get()) is not None:
                yield m
        call = self.stub.Session(messages(), metadata=workers.session_metadata(worker_id), timeout=timeout)
        call.outbox = outbox
        self.calls[worker_id] = call
        return call

    async def exchange(self, call, msg, what=""):
        call.outbox.put_nowait(msg)
        reply = await call.read()
        if reply is grpc.aio.EOF:
            call.outbox.put_nowait(None)
            raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       await call.details() or "worker ended the session")
        return reply

    async def release(self, worker_id, abort=False):
        call = self.calls.pop(worker_id, None)
        if call is None:
            return
        if abort and not call.done():
            call.cancel()
            return
        call.outbox.put_nowait(None)
        if not call.done():
            await asyncio.wait_for(call.code(), 10)

    workers._Sessions.open, workers._Sessions.exchange, workers._Sessions.release = open_, exchange, release


def start_servers(version: str, tree: str = ROOT, knobs: str = "{}") -> tuple[dict, list]:
    """The two stub workers in their own processes; returns ({role: address}, processes).
    Knob ``unix``: they listen on unix sockets (``unix:///tmp/…``) instead of TCP loopback. Knob
    ``data_channel``: they also serve their data channel (``serving.datachannel``) on a Unix socket,
    ``addresses["<role>_data"]``, which the client uses for the Session streams."""
    import tempfile

    from deploy.local import free_port, health_status

    addresses, procs = {}, []
    k = json.loads(knobs)
    sockets = tempfile.mkdtemp(prefix="bench_protocol_") if k.get("unix") or k.get("data_channel") else None
    for role in ("target", "draft"):
        addresses[role] = f"unix://{sockets}/{role}.sock" if k.get("unix") else f"127.0.0.1:{free_port()}"
        role_knobs = knobs
        if k.get("data_channel"):
            addresses[f"{role}_data"] = f"{sockets}/{role}.data"
            role_knobs = json.dumps({**k, "data_socket": addresses[f"{role}_data"]})
        procs.append(subprocess.Popen(_child(tree, "--serve", version, role, addresses[role], role_knobs),
                                      cwd=tree, env=_env(tree)))
    deadline = time.monotonic() + 60
    while any(health_status(a) != 1 for r, a in addresses.items() if not r.endswith("_data")):
        if time.monotonic() > deadline:
            raise TimeoutError("stub workers did not start")
        time.sleep(0.1)
    return addresses, procs


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{thread id: (name, CPU seconds: utime + stime)} of each live thread of ``pid`` (/proc)."""
    out = {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def thread_groups(pid: int, before: dict, after: dict) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu`` reads: main thread, gRPC's event_engine threads,
    the rest (threads that ended meanwhile are missed)."""
    out = {"main": 0.0, "event_engine": 0.0, "other": 0.0}
    for tid, (name, cpu) in after.items():
        key = "main" if tid == pid else "event_engine" if name.startswith("event_engine") else "other"
        out[key] += cpu - before.get(tid, (name, 0.0))[1]
    return out


def client(version: str, addresses: dict, pids: dict, budget: int, requests: int, rounds: int, tokenizer: str,
           sink: str | None = None, concurrency: int = 1, profile: str = "") -> dict:
    """One variant's measurement (run in the variant's client process): a warm-up request, then
    ``requests`` requests of ``rounds`` rounds, ``concurrency`` at a time (all on the client's
    one event loop and channels, as the orchestrator serves concurrent requests); wall ms per
    round per request, rounds per second over all of them (all rounds ÷ wall time of the
    measured requests), and CPU ms per round of each process over the measured requests (the
    client's own includes each request's stream set-up and detokenization; its channels are
    opened once, before). ``profile``: "phases" (the round's phase timeline) or "cprofile" (a
    profile of this process over the measured requests), returned as ``phases`` / ``cprofile``
    (``bench.protocol_profile``)."""
    global MARK
    from modeling.tokenizer import TextTokenizer

    prof_mod = _profiler() if profile else None
    if profile == "phases":
        prof_mod.install_phases()
        MARK = prof_mod.mark

    tok = TextTokenizer.from_file(tokenizer)
    prompt = tok.encode("Write a haiku about the sea.") * 4
    opener, fn = (open_v1, run_v1) if version == "v1" else (open_v2, run_v2)
    workers, pids = dict(pids), dict(pids, orchestrator=os.getpid())

    async def measure():
        import grpc

        channels, links = await opener(addresses)
        out = grpc.aio.insecure_channel(sink) if sink else None
        channels += (out,) if out else ()
        # the process's one round-shape planner and draft-health view, as the orchestrator shares them
        kw = {}
        if version != "v1":
            from orchestrator.adaptive import CPU_COSTS, BudgetPlanner
            from orchestrator.fallback import DraftHealth
            health = DraftHealth(round_timeout=2.0)  # (the orchestrator's default --draft-timeout-ms)
            from orchestrator.budget import H200_COSTS
            planner = (_one_token_planner() if ROUNDS == "one-token" else BudgetPlanner)(
                H200_COSTS if ROUNDS == "adaptive" else CPU_COSTS, **{"defer": True, **PLANNER})
            kw = {"shared": {"planner": planner, "health": health}}
        await fn(links, tok, prompt, 8, budget, out, **kw)  # warm-up
        cpu0 = {role: _cpu_seconds(pid) for role, pid in pids.items()}
        threads0 = {role: thread_cpu(pid) for role, pid in pids.items()}
        shapes0 = _round_shapes()
        batches0 = _batches(workers)
        if prof_mod:
            prof_mod.EVENTS.clear()
        wprof = profile == "cprofile" and version != "v1" and bool(addresses.get("target_data"))
        if wprof:
            prof_mod.toggle_workers(workers)
        prof = prof_mod.start_cprofile() if profile == "cprofile" else None
        c0, w0 = time.process_time(), time.perf_counter()
        if concurrency <= 1:
            runs = [await fn(links, tok, prompt, rounds, budget, out, **kw) for _ in range(requests)]
        else:
            gate = asyncio.Semaphore(concurrency)

            async def one():
                async with gate:
                    return await fn(links, tok, prompt, rounds, budget, out, **kw)
            runs = await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.perf_counter() - w0
        if prof is not None:
            prof.disable()
        if wprof:
            prof.worker_tables = prof_mod.toggle_workers(workers, read=True)
        batches1 = _batches(workers)
        shapes = {k: v - shapes0.get(k, 0) for k, v in _round_shapes().items() if v > shapes0.get(k, 0)}
        cpu = {role: _cpu_seconds(pid) - cpu0[role] for role, pid in pids.items()}
        cpu["orchestrator"] = time.process_time() - c0
        threads = {role: thread_groups(pid, threads0[role], thread_cpu(pid)) for role, pid in pids.items()}
        for c in channels:
            await c.close()
        kinds = {"target": "verify", "draft": "draft"}
        batch = {}
        for role, b in batches1.items():
            calls, items = (b[kinds[role]][i] - batches0[role][kinds[role]][i] for i in (0, 1))
            batch[kinds[role]] = round(items / max(1, calls), 2)
        return runs, cpu, threads, wall, batch, prof, shapes
    runs, cpu, threads, wall, batch, prof, shapes = asyncio.run(measure())
    per, n = [dt for dt, _ in runs], sum(k for _, k in runs)
    extra = {}
    if profile == "phases":
        extra["phases"] = prof_mod.phase_table(n)
    elif prof is not None:
        extra["cprofile"] = prof_mod.cprofile_text(prof, n)
        extra["worker_cprofile"] = getattr(prof, "worker_tables", {})
    return dict(**extra, protobuf_impl=_protobuf_impl(), python=platform.python_version(),ms_per_round=round(1000 * statistics.median(per), 3), ms_min=round(1000 * min(per), 3),
                rounds_per_s=round(n / wall, 1), mean_batch=batch, round_shapes=shapes,
                cpu_ms_per_round={k: round(1000 * v / n, 3) for k, v in cpu.items()},
                thread_cpu_ms_per_round={role: {k: round(1000 * v / n, 3) for k, v in g.items()}
                                         for role, g in threads.items()})


def _shares(counts: list[dict]) -> dict[str, float]:
    """Rounds by shape summed over runs, as shares of all of them, largest first."""
    total: dict[str, float] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    n = sum(total.values())
    return {k: v / n for k, v in sorted(total.items(), key=lambda kv: -kv[1])} if n else {}


def _round_shapes() -> dict[str, float]:
    """The round loop's rounds so far by shape verified (``orchestrator.adaptive.ROUND_SHAPES``:
    "tree@16", "one-token", …) in this process; {} for a code tree without the counter."""
    try:
        from orchestrator.adaptive import ROUND_SHAPES
    except ImportError:
        return {}
    return {m.labels["shape"]: m.value for metric in ROUND_SHAPES.collect() for m in metric.samples
            if m.name.endswith("_total")}


def _protobuf_impl() -> str:
    """The protobuf backend in this process ("upb", "cpp" or "python": pure Python parses and
    builds repeated fields element by element)."""
    try:
        from google.protobuf.internal import api_implementation
        return api_implementation.Type()
    except ImportError:
        return "?"


def variants(a) -> list[dict]:
    """(label, protocol version, code tree, knobs) to measure, in order."""
    out = []
    if "v1" in a.versions:
        out.append(dict(label="v1 (2 unary calls, accept in target)", version="v1", tree=ROOT, knobs={}))
    for spec in a.baseline:
        tree, _, label = spec.partition("=")
        tree = str(pathlib.Path(tree).resolve())
        if "v2" in a.versions:  # (the plain variant; ``--versions none``: knob variants only)
            out.append(dict(label=f"v2 at {label or tree}", version="v2", tree=tree, knobs={}))
        if a.baseline_knobs:
            out += [dict(label=f"v2 at {label or tree} + {k}", version="v2", tree=tree, knobs=json.loads(k))
                    for k in a.knobs  # (a tree from before the data channel has none to measure)
                    if not json.loads(k).get("data_channel") or pathlib.Path(tree, "serving/datachannel.py").exists()]
    if "v2" in a.versions:
        out.append(dict(label="v2", version="v2", tree=ROOT, knobs={}))
    for spec in a.knobs:
        out.append(dict(label=f"v2 + {spec}", version="v2", tree=ROOT, knobs=json.loads(spec)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=64)
    ap.add_argument("--step-ms", default="", metavar="V,D",
                    help='knob step_ms on every variant: stub verify / draft calls sleep V / D ms (as a device step)')
    ap.add_argument("--text", action="store_true",
                    help="knob text on every variant: the stub rounds emit ordinary tokens (text to detokenize)")
    ap.add_argument("--feature-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="knob feature_dtype on every variant: the stub target's feature rows (float32: 6.9 KB a row, "
                         "as CPU workers send; bfloat16: 3.5 KB, as GPU workers send in their default dtype; auto "
                         "(default): bfloat16 where CUDA is available, float32 elsewhere, as the workers' --dtype)")
    ap.add_argument("--client-python", default="",
                    help="interpreter of the client (orchestrator) processes, e.g. a Python 3.12 venv, where the "
                         "round loop starts its draft task eagerly (default: this one)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight at once in the client (the orchestrator's load; default 1: one at a time)")
    ap.add_argument("--budgets", default="4,64")
    ap.add_argument("--versions", default="v1,v2", help="which plain protocols to measure (v2 also of each --baseline "
                                                         "tree; 'none': only the --knobs variants)")
    ap.add_argument("--baseline", action="append", default=[], metavar="DIR[=LABEL]",
                    help="another checkout of this repository (e.g. `git archive <commit> | tar -x -C DIR`): its "
                         "v2 servicers and round loop are measured too, with this file's stubs (repeatable)")
    ap.add_argument("--knobs", action="append", default=[],
                    help='extra v2 variant, JSON: {"grpc_args": [["grpc.http2.bdp_probe", 0]], '
                         '"switch_interval": 0.0001, "writer_task": true} (repeatable)')
    ap.add_argument("--baseline-knobs", action="store_true",
                    help="measure every --knobs variant on each --baseline tree too (e.g. the data channel before "
                         "and after a change)")
    ap.add_argument("--repeat", type=int, default=1, help="measure the variants in turn this many times "
                                                          "(interleaved, so load drifts hit all alike)")
    ap.add_argument("--tag", help="results file suffix (default: cpu or gpu)")
    ap.add_argument("--client-writes", action="store_true",
                    help="the client writes each delta to a gRPC stream (a sink process), as the orchestrator's "
                         "servicer sends each round's chunk to its client (v2 variants)")
    ap.add_argument("--tokenizer", default=os.environ.get("SPECDEC_GGUF", ""),
                    help="GGUF file or HF tokenizer dir for the orchestrator's detokenizer (default: "
                         "$SPECDEC_GGUF, else the embedded model)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, two more client runs per variant and budget: the round's phase "
                         "timeline and a cProfile of the orchestrator (bench/protocol_profile.py); written to "
                         "bench/results/protocol_profile_<tag>.{md,json}")
    ap.add_argument("--serve", nargs=4, metavar=("VERSION", "ROLE", "ADDRESS", "KNOBS"), help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        _tune(json.loads(a.serve[3]))
        asyncio.run(serve(a.serve[0], a.serve[1], a.serve[2], json.loads(a.serve[3]).get("data_socket", "")))
        return 0
    if a.client:
        job = json.loads(a.client)
        _tune(job["knobs"])
        print(json.dumps(client(job["version"], job["addresses"], job["pids"], job["budget"], job["requests"],
                                job["rounds"], job["tokenizer"], job.get("sink"), job.get("concurrency", 1),
                                job.get("profile", ""))))
        return 0
    a.versions = a.versions.split(",")
    if a.feature_dtype == "auto":  # what the workers send by default on this host (their --dtype default)
        a.feature_dtype = "bfloat16" if _cuda() else "float32"
    if not a.tokenizer:
        from modeling.model_files import default_gguf_path
        a.tokenizer = str(default_gguf_path())
    a.tokenizer = str(pathlib.Path(a.tokenizer).resolve())
    budgets = [int(b) for b in a.budgets.split(",")]
    results: dict[tuple[str, int], list[dict]] = {}
    load = [os.getloadavg()[0]]
    sink, sink_proc = None, None
    if a.client_writes:  # bench.grpc_echo's aio server reads the client's deltas
        import grpc

        from deploy.local import free_port
        sink = f"127.0.0.1:{free_port()}"
        sink_proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_echo", "--serve", "aio", sink], cwd=ROOT,
                                     env=_env(ROOT))
    profiles: list[dict] = []
    try:
        if sink:
            grpc.channel_ready_future(grpc.insecure_channel(sink)).result(timeout=30)
        _measure(a, budgets, results, load, sink, profiles)
    finally:
        if sink_proc:
            sink_proc.terminate()
            sink_proc.wait(10)
    rows = []
    for (label, budget), rs in results.items():  # medians over the repeats
        cpu = {k: round(statistics.median(r["cpu_ms_per_round"][k] for r in rs), 3) for k in rs[0]["cpu_ms_per_round"]}
        threads = {role: {k: round(statistics.median(r["thread_cpu_ms_per_round"][role][k] for r in rs), 3)
                          for k in g} for role, g in rs[0]["thread_cpu_ms_per_round"].items()}
        rows.append(dict(protocol=label, tree_budget=budget, ms_per_round=round(statistics.median(
            r["ms_per_round"] for r in rs), 3), ms_min=min(r["ms_min"] for r in rs),
            rounds_per_s=statistics.median(r.get("rounds_per_s", 0.0) for r in rs),
            mean_batch={k: statistics.median(r["mean_batch"][k] for r in rs) for k in rs[0].get("mean_batch", {})},
            round_shapes=_shares([r.get("round_shapes", {}) for r in rs]),
            cpu_ms_per_round=cpu,
            thread_cpu_ms_per_round=threads, requests=a.requests * len(rs), rounds=a.rounds,
            concurrency=a.concurrency))
    meta = dict(host=platform.node(), cpus=os.cpu_count(), python=platform.python_version(),
                grpc=_version("grpc"), protobuf=_version("google.protobuf"), protobuf_impl=_protobuf_impl(),
                client_protobuf_impl=sorted({r.get("protobuf_impl", "?") for rs in results.values() for r in rs}),
                load_average=[round(x, 2) for x in (min(load), max(load))], repeat=a.repeat,
                concurrency=a.concurrency, step_ms=a.step_ms, text=a.text, feature_dtype=a.feature_dtype,
                busy_poll=_busy_poll(), client_python=a.client_python or sys.version.split()[0],
                when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                note="stub engines, loopback gRPC, one process per worker and for the client, τ = 4 per round"
                + (", each delta written to a client stream" if sink else ""))
    table = ("| protocol | tree budget | ms / round (median) | min | rounds / s (all requests) | "
             "mean batch verify / draft | CPU ms / round: orchestrator | target | draft |\n"
             "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(
                 f"| {r['protocol']} | {r['tree_budget']} | {r['ms_per_round']:.3f} | {r['ms_min']:.3f} | "
                 f"{r['rounds_per_s']:.0f} | {r['mean_batch'].get('verify', 0):.2f} / "
                 f"{r['mean_batch'].get('draft', 0):.2f} | "
                 f"{r['cpu_ms_per_round']['orchestrator']:.3f} | {r['cpu_ms_per_round']['target']:.3f} | "
                 f"{r['cpu_ms_per_round']['draft']:.3f} |" for r in rows))
    table += "\n\nRounds by shape verified (the measured requests, all repeats):\n\n" + "\n".join(
        f"- {r['protocol']} @{r['tree_budget']}: " + (", ".join(f"{k} {v:.1%}" for k, v in r["round_shapes"].items())
                                                     or "not counted") for r in rows)
    roles = ("orchestrator", "target", "draft")
    table += ("\n\nCPU ms / round by thread (main / gRPC event_engine / other):\n\n| protocol | tree budget | "
              + " | ".join(roles) + " |\n|---|---|---|---|---|\n" + "\n".join(
                  f"| {r['protocol']} | {r['tree_budget']} | " + " | ".join(
                      " / ".join(f"{r['thread_cpu_ms_per_round'][role][k]:.3f}" for k in ("main", "event_engine", "other"))
                      for role in roles) + " |" for r in rows))
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = a.tag or ("gpu" if _cuda() else "cpu")
    (RESULTS / f"protocol_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (RESULTS / f"protocol_{tag}.md").write_text(f"# Per-round protocol cost ({tag})\n\n`{json.dumps(meta)}`\n\n{table}\n")
    if profiles:
        merged: dict = {}
        for r in profiles:  # one row per (variant, budget): the phase run's table and the cProfile run's
            m = merged.setdefault((r["protocol"], r["tree_budget"]), dict(protocol=r["protocol"], tree_budget=r["tree_budget"]))
            for k in ("phases", "cprofile", "worker_cprofile", "protobuf_impl", "python"):
                if k in r:
                    m[k] = r[k]
            m.setdefault("ms_per_round", {})[r["profile"]] = r["ms_per_round"]
            m.setdefault("cpu_ms_per_round", {})[r["profile"]] = r["cpu_ms_per_round"]
        body = _profiler().markdown(list(merged.values()))
        (RESULTS / f"protocol_profile_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=list(merged.values())),
                                                                         indent=1))
        (RESULTS / f"protocol_profile_{tag}.md").write_text(
            f"# Where the stub round goes in the orchestrator ({tag})\n\n`{json.dumps(meta)}`\n\n"
            "The profiled runs (phases: hooks only; cprofile: under the profiler), ms / round and CPU ms / round "
            "per process:\n\n" + "\n".join(
                f"- {m['protocol']} @{m['tree_budget']}: {m['ms_per_round']}, {m['cpu_ms_per_round']}"
                for m in merged.values())
            + f"\n\n{body}\n")
        print(body)
    return 0


def _measure(a, budgets: list[int], results: dict, load: list, sink: str | None, profiles: list) -> None:
    """Every variant in turn, ``a.repeat`` times; each result appended to ``results[(label, budget)]``.
    With ``a.profile``, in the last repeat also a phase run and a cProfile run per variant and
    budget, appended to ``profiles``."""
    step = {"step_ms": [float(x) for x in a.step_ms.split(",")]} if a.step_ms else {}
    if a.text:
        step["text"] = True
    if a.feature_dtype != "float32":
        step["feature_dtype"] = a.feature_dtype
    for rep in range(a.repeat):
        for v in variants(a):
            v["knobs"] = {**step, **v["knobs"]}
            knobs = json.dumps(v["knobs"])
            addresses, procs = start_servers(v["version"], v["tree"], knobs)
            try:
                runs = [(b, "") for b in budgets]
                if a.profile and rep == a.repeat - 1:
                    runs += [(b, kind) for b in budgets for kind in ("phases", "cprofile")]
                for budget, profile in runs:
                    job = dict(version=v["version"], addresses=addresses, pids=dict(zip(("target", "draft"),
                                                                            [p.pid for p in procs])),
                               budget=budget, requests=a.requests, rounds=a.rounds, knobs=v["knobs"],
                               tokenizer=a.tokenizer, sink=sink, concurrency=a.concurrency, profile=profile)
                    out = subprocess.run(_child(v["tree"], "--client", json.dumps(job), python=a.client_python),
                                         cwd=v["tree"],
                                         env=_env(v["tree"]), capture_output=True, text=True)
                    if out.returncode:
                        raise RuntimeError(f"client of {v['label']} failed:\n{out.stderr[-3000:]}")
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    if profile:
                        profiles.append(dict(protocol=v["label"], tree_budget=budget, profile=profile, **r))
                        print(json.dumps(dict(protocol=v["label"], tree_budget=budget, profile=profile,
                                              ms_per_round=r["ms_per_round"], phases=r.get("phases"))), flush=True)
                        continue
                    results.setdefault((v["label"], budget), []).append(r)
                    print(json.dumps(dict(protocol=v["label"], tree_budget=budget, **r)), flush=True)
            finally:
                for p in procs:
                    p.terminate()
                    p.wait(10)
                for d in {os.path.dirname(x.removeprefix("unix://")) for r, x in addresses.items()
                          if r.endswith("_data") or x.startswith("unix://")}:  # (the sockets' temporary directory)
                    shutil.rmtree(d, ignore_errors=True)
            load.append(os.getloadavg()[0])


def _busy_poll() -> dict:
    """What busy-polling is for a variant that sets no ``SPECDEC_SPIN_US`` knob: this environment's
    value (None: unset) and the window that resolves to on this host (µs; unset: auto)."""
    try:
        from serving.datachannel import spin_settings, usable_cpus
        return dict(env=os.environ.get("SPECDEC_SPIN_US"), spin_us=round(spin_settings()[0] * 1e6),
                    usable_cpus=usable_cpus())
    except (ImportError, ValueError) as e:
        return dict(env=os.environ.get("SPECDEC_SPIN_US"), error=str(e))


def _version(module: str) -> str:
    try:
        return __import__(module, fromlist=["__version__"]).__version__
    except ImportError:
        return "?"


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
