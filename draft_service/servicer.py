"""gRPC servicer for specdec.v1.DraftService (the only draft code touching generated types)."""
from __future__ import annotations

import grpc

from draft_service.engine import DraftEngine
from serving.logs import bind_request
from serving.server import ServiceHost, engine_errors
from serving.tensors import from_proto
from specdec_proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc

_MODES = {draft_pb2.TREE_MODE_CHAIN: "chain", draft_pb2.TREE_MODE_TREE: "tree"}


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, host: ServiceHost, engine_ref: dict):
        self.host = host
        self.ref = engine_ref  # {"engine": DraftEngine} once loaded

    @property
    def engine(self) -> DraftEngine:
        return self.ref["engine"]

    async def _ready(self, context):
        if "engine" not in self.ref:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is loading")

    async def Draft(self, request, context):
        await self._ready(context)
        results = []
        async with engine_errors(context):
            for i, item in enumerate(request.items):
                bind_request(item.request_id)
                mode = _MODES.get(item.mode, f"unknown({item.mode})")
                feats = from_proto(item.context_features, f"items[{i}].context_features")
                tokens, parents = await self.host.run_engine(
                    self.engine.draft, item.request_id, feats, item.context_start, item.bonus_token,
                    mode, item.budget)
                results.append(draft_pb2.DraftResult(
                    request_id=item.request_id, tree=common_pb2.TokenTree(tokens=tokens, parents=parents)))
        return draft_pb2.DraftResponse(results=results)

    async def Release(self, request, context):
        await self._ready(context)
        n = await self.host.run_engine(self.engine.release, list(request.request_ids))
        return common_pb2.ReleaseResponse(released=n)

    async def GetInfo(self, request, context):
        await self._ready(context)
        e = self.engine
        c = e.cfg
        return draft_pb2.DraftInfo(
            model_name=e.name, block_size=c.block_size, target_layer_ids=list(c.target_layer_ids),
            hidden_size=c.hidden_size, vocab_size=c.vocab_size, mask_token_id=c.mask_token_id,
            max_budget=e.max_budget, device=str(e.device), live_requests=e.live_requests)
