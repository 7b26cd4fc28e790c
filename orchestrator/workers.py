"""gRPC clients of the two workers; convert engine dataclasses ⇄ specdec.v1 messages."""
from __future__ import annotations

import asyncio

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeling.results import PrefillOutput, VerifyOutput
from modeling.sampling import SamplingParams
from serving.server import channel_options
from serving.tensors import from_proto, to_proto
from specdec_proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

_TREE_MODES = {"chain": draft_pb2.TREE_MODE_CHAIN, "tree": draft_pb2.TREE_MODE_TREE}


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


async def wait_serving(channel: grpc.aio.Channel, timeout: float) -> None:
    """Poll grpc.health.v1 until SERVING; raises TimeoutError."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("worker did not become SERVING in time")
        await asyncio.sleep(0.2)


class TargetWorker:
    """Implements ``generation.TargetClient`` over gRPC."""

    def __init__(self, address: str, max_message_mb: int = 64):
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_mb))
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    async def info(self) -> target_pb2.TargetInfo:
        return await self.stub.GetInfo(common_pb2.InfoRequest())

    async def prefill(self, request_id, prompt, max_new_tokens, sampling, return_features) -> PrefillOutput:
        item = target_pb2.PrefillItem(request_id=request_id, prompt_tokens=prompt, max_new_tokens=max_new_tokens,
                                      sampling=sampling_to_proto(sampling), return_features=return_features)
        r = (await self.stub.Prefill(target_pb2.PrefillRequest(items=[item]))).results[0]
        feats = from_proto(r.context_features) if r.HasField("context_features") else None
        return PrefillOutput(r.first_token, feats)

    async def verify(self, request_id, tokens, parents, sampling, return_features) -> VerifyOutput:
        item = target_pb2.VerifyItem(request_id=request_id, tree=common_pb2.TokenTree(tokens=tokens, parents=parents),
                                     sampling=sampling_to_proto(sampling), return_features=return_features)
        r = (await self.stub.Verify(target_pb2.VerifyRequest(items=[item]))).results[0]
        feats = from_proto(r.context_features) if r.HasField("context_features") else None
        return VerifyOutput(list(r.accepted_nodes), r.bonus_token, list(r.node_samples), r.expected_accepted, feats)

    async def release(self, request_id: str) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(request_ids=[request_id]), timeout=10)


class DraftWorker:
    """Implements ``generation.DraftClient`` over gRPC."""

    def __init__(self, address: str, max_message_mb: int = 64):
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_mb))
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)

    async def info(self) -> draft_pb2.DraftInfo:
        return await self.stub.GetInfo(common_pb2.InfoRequest())

    async def draft(self, request_id, features: torch.Tensor, context_start, bonus, mode, budget):
        item = draft_pb2.DraftItem(request_id=request_id, context_features=to_proto(features),
                                   context_start=context_start, bonus_token=bonus, mode=_TREE_MODES[mode],
                                   budget=budget)
        r = (await self.stub.Draft(draft_pb2.DraftRequest(items=[item]))).results[0]
        return list(r.tree.tokens), list(r.tree.parents)

    async def release(self, request_id: str) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(request_ids=[request_id]), timeout=10)
