"""gRPC servicer for specdec.v2.DraftService (the only draft code touching generated types).

One ``Session`` stream per request; its first message binds mode and tree budget; the
drafter context is released when the stream ends."""
from __future__ import annotations

import asyncio

import grpc
import structlog

from draft_service.engine import DraftEngine
from protocol import wire
from serving import metrics
from serving.logs import bind_session
from serving.server import ServiceHost
from specdec_proto.v2 import draft_pb2, draft_pb2_grpc

log = structlog.get_logger()


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, host: ServiceHost, engine_ref: dict):
        self.host = host
        self.ref = engine_ref  # {"engine": DraftEngine} once loaded
        self.sessions: set[str] = set()  # worker ids with an open Session stream
        metrics.watch_engine(engine_ref)
        self._draft_seconds = metrics.WORKER_SECONDS.labels("draft")

    @property
    def engine(self) -> DraftEngine:
        return self.ref["engine"]

    async def _ready(self, context):
        if "engine" not in self.ref:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is loading")

    async def Session(self, request_iterator, context):
        await self._ready(context)
        worker_id = bind_session(context)
        if worker_id in self.sessions:  # refused before it owns anything: the live session keeps its context
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker id {worker_id!r} already has a live session")
        self.sessions.add(worker_id)
        try:
            async with wire.engine_errors(context):
                async for msg in request_iterator:
                    mode = budget = None
                    if msg.HasField("open"):
                        mode, budget = wire.mode_from_v2(msg.open.mode, "open.mode").value, msg.open.tree_budget
                        log.info("open", mode=mode, tree_budget=budget)
                    feats = wire.tensor_from_proto(msg.context_features, "context_features")
                    with self._draft_seconds.time():  # inline: no thread hop when the engine is idle
                        tokens, parents = await self.host.run_engine(
                            self.engine.draft, worker_id, feats, msg.context_start, msg.bonus_token, mode, budget,
                            inline=True)
                    yield wire.draft_reply(tokens, parents)
        finally:
            try:
                await asyncio.shield(asyncio.to_thread(self.engine.release, [worker_id]))
            finally:  # logged on cancellation too (the shielded release still completes)
                self.sessions.discard(worker_id)
                log.info("released")

    async def GetInfo(self, request, context):
        await self._ready(context)
        e = self.engine
        c = e.cfg
        return draft_pb2.DraftInfo(
            model_name=e.name, block_size=c.block_size, taps=list(c.target_layer_ids),
            hidden_size=c.hidden_size, vocab_size=c.vocab_size, mask_token_id=c.mask_token_id,
            max_tree_budget=e.max_tree_budget, max_context=e.max_context, device=str(e.device),
            live_requests=e.live_requests)
