"""gRPC servicer for specdec.v1.TargetService (the only target code touching generated types)."""
from __future__ import annotations

import asyncio

import structlog

from serving.logs import bind_request
from serving.sampling import sampling_from_proto
from serving.server import ServiceHost, engine_errors
from serving.tensors import to_proto
from specdec_proto.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine

log = structlog.get_logger()


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, host: ServiceHost, engine_ref: dict):
        self.host = host
        self.ref = engine_ref  # {"engine": TargetEngine} once loaded

    @property
    def engine(self) -> TargetEngine:
        return self.ref["engine"]

    async def _ready(self, context):
        import grpc

        if "engine" not in self.ref:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target is loading")

    async def Prefill(self, request, context):
        await self._ready(context)
        results = []
        try:
            async with engine_errors(context):
                for i, item in enumerate(request.items):
                    bind_request(item.request_id)
                    out = await self.host.run_engine(
                        self.engine.prefill, item.request_id, list(item.prompt_tokens), item.max_new_tokens,
                        sampling_from_proto(item.sampling, f"items[{i}].sampling"), item.return_features)
                    log.info("prefill", prompt_tokens=len(item.prompt_tokens))
                    results.append(target_pb2.PrefillResult(
                        request_id=item.request_id, first_token=out.first_token,
                        context_features=to_proto(out.features) if out.features is not None else None))
        except BaseException:  # a failed or cancelled batch keeps none of its items
            await asyncio.to_thread(self.engine.release, [r.request_id for r in results])
            raise
        return target_pb2.PrefillResponse(results=results)

    async def Verify(self, request, context):
        await self._ready(context)
        results = []
        async with engine_errors(context):
            for i, item in enumerate(request.items):
                bind_request(item.request_id)
                out = await self.host.run_engine(
                    self.engine.verify, item.request_id, list(item.tree.tokens), list(item.tree.parents),
                    sampling_from_proto(item.sampling, f"items[{i}].sampling"), item.return_features)
                results.append(target_pb2.VerifyResult(
                    request_id=item.request_id, accepted_nodes=out.accepted_nodes, bonus_token=out.bonus_token,
                    node_samples=out.node_samples, expected_accepted=out.expected_accepted,
                    context_features=to_proto(out.features) if out.features is not None else None))
        return target_pb2.VerifyResponse(results=results)

    async def Release(self, request, context):
        await self._ready(context)
        # Not queued behind model work on the engine thread: it only takes the engine lock.
        n = await asyncio.to_thread(self.engine.release, list(request.request_ids))
        return common_pb2.ReleaseResponse(released=n)

    async def GetInfo(self, request, context):
        await self._ready(context)
        e = self.engine
        c = e.model.cfg
        return target_pb2.TargetInfo(
            model_name=c.name, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
            tapped_layers=list(e.taps), max_context=e.max_context, max_tree_nodes=e.max_tree_nodes,
            eos_token_ids=list(c.eos_token_ids), dtype=str(e.model.lm_head.weight.dtype).removeprefix("torch."),
            device=str(e.device), kv_pool_tokens=e.kv_pool_tokens, live_requests=e.live_requests,
            kv_reserved_tokens=e.reserved_tokens)
