"""Blocking helper for the workers' v2 ``Session`` streams (test-only)."""
from __future__ import annotations

import queue

import grpc

from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import draft_pb2_grpc, target_pb2_grpc


class Session:
    """One open ``Session`` stream (``rpc`` "Steps": a Steps stream): ``send`` writes a message
    and returns its reply."""

    def __init__(self, stub, worker_id: str, rpc: str = "Session"):
        self._q: queue.Queue = queue.Queue()
        self._replies = getattr(stub, rpc)(iter(self._q.get, None), metadata=(("x-worker-id", worker_id),
                                                                              ("x-request-id", "test")))

    def send(self, msg):
        self._q.put(msg)
        return next(self._replies)

    def close(self) -> None:
        """End the stream and wait until the worker finished it (state released)."""
        self._q.put(None)
        for _ in self._replies:
            pass


def live(stack) -> tuple[int, int, int]:
    """(target live requests, target reserved KV rows, drafter live requests)."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['target']}") as t, \
            grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as d:
        ti = target_pb2_grpc.TargetServiceStub(t).GetInfo(common_pb2.InfoRequest())
        di = draft_pb2_grpc.DraftServiceStub(d).GetInfo(common_pb2.InfoRequest())
    return ti.live_requests, ti.kv_reserved_tokens, di.live_requests
