"""gRPC servicer for specdec.v2.TargetService (the only target code touching generated types).

One ``Session`` stream per request: open (prefill) then one verify per round; the request's
KV is released when the stream ends, however it ends."""
from __future__ import annotations

import asyncio

import grpc
import structlog

from protocol import wire
from protocol.types import FailedPrecondition, InvalidRequest, ResourceExhausted
from serving import metrics
from serving.logs import bind_session
from serving.server import ServiceHost
from specdec_proto.v2 import target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine

log = structlog.get_logger()


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, host: ServiceHost, engine_ref: dict):
        self.host = host
        self.ref = engine_ref  # {"engine": TargetEngine} once loaded
        metrics.watch_engine(engine_ref, kv=True)
        self._verify_seconds = metrics.WORKER_SECONDS.labels("verify")

    @property
    def engine(self) -> TargetEngine:
        return self.ref["engine"]

    async def _ready(self, context):
        if "engine" not in self.ref:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target is loading")

    async def Session(self, request_iterator, context):
        await self._ready(context)
        worker_id, opened, started = bind_session(context), False, False
        try:
            async with wire.engine_errors(context):
                async for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "open" and not opened:
                        o = msg.open
                        started = True  # from here on the engine may hold state for worker_id
                        try:
                            with metrics.WORKER_SECONDS.labels("prefill").time():
                                out = await self.host.run_engine(
                                    self.engine.prefill, worker_id, list(o.prompt_tokens), o.max_new_tokens,
                                    wire.sampling_from_proto(o.sampling, "open.sampling"),
                                    wire.mode_from_v2(o.mode, "open.mode").value, o.tree_budget)
                        except (InvalidRequest, ResourceExhausted):  # refused: nothing of this session to free
                            started = False  # (a duplicate id must not release the live session's KV)
                            raise
                        opened = True
                        log.info("open", prompt_tokens=len(o.prompt_tokens), tree_budget=o.tree_budget)
                        yield wire.opened_to_proto(out)
                    elif kind == "verify" and opened:
                        v = msg.verify
                        with self._verify_seconds.time():  # inline: no thread hop when the engine is idle
                            out = await self.host.run_engine(self.engine.verify, worker_id, list(v.tree.tokens),
                                                             list(v.tree.parents), list(v.commit) or None,
                                                             inline=True)
                        yield wire.verified_to_proto(out)
                    else:
                        raise FailedPrecondition("a session sends open once, first, then verify messages")
        finally:  # not queued behind model work: release only takes the engine lock
            if started:
                try:
                    await asyncio.shield(asyncio.to_thread(self.engine.release, [worker_id]))
                finally:  # logged on cancellation too (the shielded release still completes)
                    log.info("released")

    async def GetInfo(self, request, context):
        await self._ready(context)
        e = self.engine
        c = e.model.cfg
        return target_pb2.TargetInfo(
            model_name=c.name, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
            taps=list(e.taps), max_context=e.max_context, max_tree_budget=e.max_tree_budget,
            eos_token_ids=list(c.eos_token_ids), dtype=str(e.model.lm_head.weight.dtype).removeprefix("torch."),
            device=str(e.device), kv_pool_tokens=e.kv_pool_tokens, live_requests=e.live_requests,
            kv_reserved_tokens=e.reserved_tokens)
