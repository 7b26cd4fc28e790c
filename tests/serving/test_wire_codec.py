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
    empty = to_proto(torch.zeros(0, 2))
    empty.shape[:] = [2 ** 62, 0]  # no bytes, but a shape torch cannot size (was UNKNOWN: RuntimeError)
    with pytest.raises(InvalidRequest, match="dimension"):
        from_proto(empty)


def test_generated_code_matches_protos():
    import subprocess
    import sys

    from deploy.local import ROOT

    r = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_fresh_seed_leaves_the_global_random_state_alone():
    """A request without a seed gets a fresh 64-bit one from the OS, not from the process's `random`:
    a server thread drawing from it would advance a generator the embedding program seeded (and
    Hypothesis flags such draws during the fuzz tests' strategies)."""
    import random

    from protocol.wire import sampling_from_proto
    from specdec_proto.v1 import common_pb2

    random.seed(1234)
    state = random.getstate()
    seeds = {sampling_from_proto(common_pb2.SamplingParams(temperature=1.0), draw_seed=True).seed for _ in range(8)}
    assert random.getstate() == state
    assert len(seeds) == 8 and all(0 <= s < 2 ** 64 for s in seeds)
    assert sampling_from_proto(common_pb2.SamplingParams(temperature=1.0, seed=7), draw_seed=True).seed == 7
    assert sampling_from_proto(common_pb2.SamplingParams(temperature=1.0)).seed == 0
