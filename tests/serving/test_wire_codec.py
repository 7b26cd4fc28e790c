"""The wire layer (protocol.wire): tensor codec, and the generated protobuf code."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from modeling.errors import InvalidRequest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_codec_roundtrip(dtype):
    from protocol.wire import tensor_from_proto as from_proto, tensor_to_proto as to_proto

    t = torch.randn(3, 5).to(dtype)
    assert torch.equal(from_proto(to_proto(t)), t)
    msg = to_proto(t)
    msg.shape[:] = [4, 5]
    with pytest.raises(InvalidRequest, match="bytes do not match"):
        from_proto(msg, "context_features")


def test_tensor_shape_overflow_is_invalid():
    from protocol.wire import tensor_from_proto as from_proto, tensor_to_proto as to_proto

    msg = to_proto(torch.zeros(2, 2))
    msg.shape[:] = [2 ** 62 + 1, 4]
    with pytest.raises(InvalidRequest):
        from_proto(msg)


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 40_000)), st.integers(0, 2 ** 31 - 1), st.integers(0, 2 ** 31 - 1),
       st.sampled_from([None, "tree", "chain", "autoregressive"]), st.integers(0, 512), st.one_of(st.none(), st.integers(1, 512)))
@example(112, 3, 7, "tree", 16, None)  # the Tensor's encoding 127 / 128 / 16383 / 16384 bytes: the length's varint grows
@example(113, 3, 7, None, 16, 4)
@example(16366, 0, 1, None, 0, None)
@example(16367, 0, 1, "chain", 0, None)
def test_draft_message_chunks_decode_as_the_draft_message(size, start, bonus, mode, budget, round_budget):
    """The data channel's pre-serialized draft message (features forwarded as their own
    encoding behind a hand-written tag and length) parses as ``draft_message`` of the same
    arguments, for feature sizes on both sides of every varint length boundary up to 40 KB."""
    from protocol.types import Mode
    from protocol.wire import draft_message, draft_message_chunks
    from specdec_proto.v1 import common_pb2
    from specdec_proto.v2 import draft_pb2

    feats = None if size is None else common_pb2.Tensor(dtype="float32", shape=[1, size // 4], data=bytes(size))
    args = (feats, start, bonus, None if mode is None else Mode(mode), budget, round_budget)
    assert draft_pb2.DraftMessage.FromString(b"".join(draft_message_chunks(*args))) == draft_message(*args)


def test_generated_code_matches_protos():
    import subprocess
    import sys

    from deploy.local import ROOT

    r = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
