"""gRPC servicer for specdec.v2.TargetService (the only target code touching generated types).

One ``Session`` stream per request: open (prefill) then one verify per round; the request's
KV is released when the stream ends, however it ends. Runs on the worker's threaded gRPC server
(``serving.server``): the stream's handler thread runs the prefill itself (no host lock: the
engine interleaves prefill chunks with verify batches, and an open that waits for KV rows while
the pool is full — up to the RPC's deadline — holds up no other open) and hands each verify to
the step batcher, which runs the verifies of all streams queued meanwhile as one
``TargetEngine.verify_batch`` (issue 14); each stream gets its own result or error. A ``Steps``
stream (``serving.steps``) carries many opened requests' verifies per message instead."""
from __future__ import annotations

import functools
import time

import grpc
import structlog

from protocol import wire
from protocol.types import FailedPrecondition, InvalidRequest, ResourceExhausted
from serving import metrics
from serving.logs import bind_session
from serving.server import ServiceHost, engine_errors
from serving.steps import serve_steps
from specdec_proto.v2 import target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine, VerifyItem

log = structlog.get_logger()


#: an open without a deadline waits this long at most for KV rows (a client that gives up
#: cancels, and its release ends the wait at once)
NO_DEADLINE_WAIT = 24 * 3600.0


def admission_wait(context: grpc.ServicerContext) -> float:
    """Seconds an open may wait for KV rows while the pool is full (``TargetEngine.prefill``'s
    ``wait_seconds``): what is left of the RPC's deadline, at most ``NO_DEADLINE_WAIT`` — gRPC
    Python reports an RPC without a deadline as ~9.2e18 s left (not None), more than
    ``threading`` can wait."""
    left = context.time_remaining()
    return NO_DEADLINE_WAIT if left is None else min(left, NO_DEADLINE_WAIT)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    data_socket = ""  # the data channel's path, advertised in GetInfo (serving.datachannel)
    data_nonce = ""  # its instance nonce, advertised with it

    def __init__(self, host: ServiceHost, engine_ref: dict):
        self.host = host
        self.ref = engine_ref  # {"engine": TargetEngine} once loaded
        metrics.watch_engine(engine_ref, kv=True)
        self._prefill_seconds = metrics.WORKER_SECONDS.labels("prefill")
        self._verify_seconds = metrics.WORKER_SECONDS.labels("verify")
        self._verify_batch_seconds = metrics.BATCH_SECONDS.labels("verify")
        self.batcher = host.batcher(self._run_batch, "verify-batcher",
                                    functools.partial(metrics.defer, metrics.BATCH_SIZE.labels("verify").observe),
                                    lambda: self.engine.live_requests,  # each sends one verify per round
                                    lambda item: item.request_id)

    def _run_batch(self, items):
        t = time.perf_counter()
        try:
            return self.engine.verify_batch(items)
        finally:  # (observed once its leader's reply is out: ``metrics.defer``)
            metrics.defer(self._verify_batch_seconds.observe, time.perf_counter() - t)

    @property
    def engine(self) -> TargetEngine:
        return self.ref["engine"]

    def _ready(self, context):
        if "engine" not in self.ref:
            context.abort(grpc.StatusCode.UNAVAILABLE, "target is loading")

    def Session(self, request_iterator, context):
        self._ready(context)
        worker_id, engine, opened = bind_session(context), self.engine, False
        # the KV is released once: at the end of this handler, or as soon as the RPC ends (a cancel
        # then reaches a running prefill); armed only while the engine may hold state for worker_id
        release = self.host.on_end(context, lambda: (engine.release([worker_id]), self.batcher.leave(worker_id)))
        release.armed = False
        try:
            with engine_errors(context):
                for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "open" and not opened:
                        o = msg.open
                        release.armed = True  # from here on the engine may hold state for worker_id
                        try:
                            with self._prefill_seconds.time():
                                out = engine.prefill(worker_id, list(o.prompt_tokens), o.max_new_tokens,
                                                     wire.sampling_from_proto(o.sampling, "open.sampling"),
                                                     wire.mode_from_v2(o.mode, "open.mode").value, o.tree_budget,
                                                     admission_wait(context), hold=o.hold_features)
                        except (InvalidRequest, ResourceExhausted):  # refused: nothing of this session to free
                            release.armed = False  # (a duplicate id must not release the live session's KV)
                            raise
                        opened = True
                        log.info("open", prompt_tokens=len(o.prompt_tokens), tree_budget=o.tree_budget)
                        yield wire.opened_to_proto(out)
                    elif kind == "verify" and opened:
                        v, t = msg.verify, time.perf_counter()
                        tree = v.tree  # (slices: one C copy each, cheaper than list())
                        item = VerifyItem(worker_id, tree.tokens[:], tree.parents[:], v.commit[:] or None,
                                          v.hold_features)
                        try:
                            out = self.batcher.submit(item, context.is_active)
                        finally:
                            metrics.defer(self._verify_seconds.observe, time.perf_counter() - t)
                        yield wire.verified_to_proto(out)
                        metrics.flush()  # the reply is out: this round's observations, off its critical path
                    else:
                        raise FailedPrecondition("a session sends open once, first, then verify messages")
        finally:  # not behind model work: release only takes the engine's state lock
            metrics.flush()
            if release.armed:
                release()
                log.info("released")

    def Steps(self, request_iterator, context):
        """Many requests' verifies a message (``serving.steps``): each item's request must have an
        open Session here (else NOT_FOUND for that item); one reply per message."""
        self._ready(context)
        bind_session(context)

        def decode(item):
            if not item.HasField("verify"):
                raise InvalidRequest("a Steps item needs verify (commit, tree)")
            v = item.verify
            tree = v.tree
            return VerifyItem(item.worker_id, tree.tokens[:], tree.parents[:], v.commit[:] or None, v.hold_features)
        yield from serve_steps(request_iterator, context, self.batcher, decode, wire.target_step_reply,
                               self._verify_seconds)

    def GetInfo(self, request, context):
        self._ready(context)
        e = self.engine
        c = e.model.cfg
        return target_pb2.TargetInfo(
            model_name=c.name, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
            taps=list(e.taps), max_context=e.max_context, max_tree_budget=e.max_tree_budget,
            eos_token_ids=list(c.eos_token_ids), dtype=str(e.model.lm_head.weight.dtype).removeprefix("torch."),
            device=str(e.device), kv_pool_tokens=e.kv_pool_tokens, live_requests=e.live_requests,
            kv_reserved_tokens=e.reserved_tokens, data_socket=self.data_socket, data_nonce=self.data_nonce)
