"""A client that cancels mid-stream leaves no KV or drafter context behind."""
import time

import grpc

from specdec_client.client import build_request
from sessions import live
from specdec_proto.v1 import orchestrator_pb2_grpc


def test_cancel_frees_worker_state(stack, client):
    with grpc.insecure_channel(stack.address) as ch:
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            build_request("Tell me a long story about dragons.", max_tokens=400, mode="tree", tree_budget=8,
                          ignore_eos=True))
        next(call)  # the first delta arrived: the request holds KV on both workers
        assert live(stack)[0] == 1
        call.cancel()
    deadline = time.monotonic() + 60
    while live(stack) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live(stack) == (0, 0, 0)
    # Finished requests are released too.
    client.generate(prompt="One two three", max_tokens=5, mode="chain")
    assert live(stack) == (0, 0, 0)
