"""gRPC servicer for specdec.v2.DraftService (the only draft code touching generated types).

One ``Session`` stream per request; its first message binds mode and tree budget; the
drafter context is released when the stream ends. Runs on the worker's threaded gRPC server
(``serving.server``): the stream's handler thread hands each draft message to the step
batcher, which runs the messages of all streams queued meanwhile as one
``DraftEngine.draft_batch`` (issue 14); each stream gets its own tree or error. A ``Steps``
stream (``serving.steps``) carries many opened requests' draft messages per message instead."""
from __future__ import annotations

import functools
import threading
import time

import grpc
import structlog

from draft_service.engine import DraftEngine, DraftItem
from protocol import wire
from protocol.types import FailedPrecondition, InvalidRequest, UnknownRequest
from serving import metrics
from serving.logs import bind_session
from serving.server import ServiceHost, engine_errors
from serving.steps import serve_steps
from specdec_proto.v2 import draft_pb2, draft_pb2_grpc

log = structlog.get_logger()


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    data_socket = ""  # the data channel's path, advertised in GetInfo (serving.datachannel)
    data_nonce = ""  # its instance nonce, advertised with it

    def __init__(self, host: ServiceHost, engine_ref: dict):
        self.host = host
        self.ref = engine_ref  # {"engine": DraftEngine} once loaded
        self.sessions: set[str] = set()  # worker ids with an open Session stream
        self._sessions_lock = threading.Lock()
        metrics.watch_engine(engine_ref)
        self._draft_seconds = metrics.WORKER_SECONDS.labels("draft")
        self._draft_batch_seconds = metrics.BATCH_SECONDS.labels("draft")
        self.batcher = host.batcher(self._run_batch, "draft-batcher",
                                    functools.partial(metrics.defer, metrics.BATCH_SIZE.labels("draft").observe),
                                    lambda: len(self.sessions),  # each sends one draft per round
                                    lambda item: item.request_id)

    def _run_batch(self, items):
        t = time.perf_counter()
        try:
            return self.engine.draft_batch(items)
        finally:  # (observed once its leader's reply is out: ``metrics.defer``)
            metrics.defer(self._draft_batch_seconds.observe, time.perf_counter() - t)

    @property
    def engine(self) -> DraftEngine:
        return self.ref["engine"]

    def _ready(self, context):
        if "engine" not in self.ref:
            context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is loading")

    def Session(self, request_iterator, context):
        self._ready(context)
        worker_id, engine = bind_session(context), self.engine
        with self._sessions_lock:  # refused before it owns anything: the live session keeps its context
            duplicate = worker_id in self.sessions
            self.sessions.add(worker_id)
        if duplicate:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker id {worker_id!r} already has a live session")

        def end():
            engine.release([worker_id])
            with self._sessions_lock:
                self.sessions.discard(worker_id)
            self.batcher.leave(worker_id)  # a gather window waiting for this session ends
        release = self.host.on_end(context, end)  # once: here or as soon as the RPC ends
        try:
            with engine_errors(context):
                for n, msg in enumerate(request_iterator):
                    mode = budget = None
                    if n == 0 and not msg.HasField("open"):
                        raise FailedPrecondition("the first message of a draft session must carry open "
                                                 "(mode, tree_budget)")
                    if msg.HasField("open"):
                        mode, budget = wire.mode_from_v2(msg.open.mode, "open.mode").value, msg.open.tree_budget
                        log.info("open", mode=mode, tree_budget=budget)
                    item = self._item(worker_id, msg, mode, budget)
                    t = time.perf_counter()
                    try:
                        tokens, parents = self.batcher.submit(item, context.is_active)
                    finally:
                        metrics.defer(self._draft_seconds.observe, time.perf_counter() - t)
                    yield wire.draft_reply(tokens, parents)
                    metrics.flush()  # the reply is out: this round's observations, off its critical path
        finally:
            metrics.flush()
            if not release():  # it ran early, when the RPC ended: a draft running then may have opened
                end()          # the context afterwards (the engine ignores an unknown id): free it now
            log.info("released")

    @staticmethod
    def _item(worker_id: str, msg, mode: str | None = None, budget: int | None = None) -> DraftItem:
        feats = wire.tensor_from_proto(msg.context_features, "context_features")
        return DraftItem(worker_id, feats, msg.context_start, msg.bonus_token, mode, budget,
                         msg.round_budget or None)  # 0: the bound budget

    def Steps(self, request_iterator, context):
        """Many requests' draft messages a message (``serving.steps``): each item's request must
        have an open Session here whose first message bound its mode (else NOT_FOUND /
        INVALID_ARGUMENT for that item); one reply per message."""
        self._ready(context)
        bind_session(context)

        def decode(item):
            if item.draft.HasField("open"):
                raise InvalidRequest("a Steps item carries no open: a request's first draft message goes on its "
                                     "Session")
            with self._sessions_lock:
                live = item.worker_id in self.sessions
            if not live:
                raise UnknownRequest(f"worker id {item.worker_id[:64]!r} has no open draft Session")
            if not self.engine.holds(item.worker_id):
                raise FailedPrecondition(f"worker id {item.worker_id[:64]!r}: its Session has not sent its first "
                                         "draft message (open: mode, tree_budget) yet")
            return self._item(item.worker_id, item.draft)
        yield from serve_steps(request_iterator, context, self.batcher, decode, wire.draft_step_reply,
                               self._draft_seconds)

    def GetInfo(self, request, context):
        self._ready(context)
        e = self.engine
        c = e.cfg
        return draft_pb2.DraftInfo(
            model_name=e.name, block_size=c.block_size, taps=list(c.target_layer_ids),
            hidden_size=c.hidden_size, vocab_size=c.vocab_size, mask_token_id=c.mask_token_id,
            max_tree_budget=e.max_tree_budget, max_context=e.max_context, device=str(e.device),
            live_requests=e.live_requests, data_socket=self.data_socket, data_nonce=self.data_nonce)
