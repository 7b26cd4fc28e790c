"""The wire layer (protocol.wire): tensor codec, and the generated protobuf code."""
import pytest
import torch

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


def test_generated_code_matches_protos():
    import subprocess
    import sys

    from deploy.local import ROOT

    r = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
