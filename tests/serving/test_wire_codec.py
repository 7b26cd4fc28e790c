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


def test_hold_and_held_rows_cross_the_wire():
    """``hold_features`` on an open and a verify (Session message and Steps item) and
    ``held_rows`` on a verify's reply survive encoding; all default to off / 0."""
    from modeling.sampling import SamplingParams
    from protocol import wire
    from protocol.types import Mode, Verified

    assert wire.target_verify([5], [-1], [0], hold=True).verify.hold_features
    assert wire.target_open([5], 4, SamplingParams(), Mode.TREE, 4, hold=True).open.hold_features
    assert not wire.target_open([5], 4, SamplingParams(), Mode.TREE, 4).open.hold_features
    assert not wire.target_verify([5], [-1], [0]).verify.hold_features
    step = wire.target_step([("a", [5], [-1], None, True), ("b", [6], [-1], [0], False), ("c", [7], [-1], None)])
    assert [it.verify.hold_features for it in step.items] == [True, False, False]
    out = Verified([9], [1.0], [0], torch.zeros(4, 3), held_rows=3)
    back = wire.verified_from(wire.target_step_reply([out]).results[0].verified)
    assert back.held_rows == 3 and list(back.features.shape) == [4, 3]
    assert wire.verified_from(wire.target_step_reply([Verified([9], [1.0], [0], None)]).results[0].verified).held_rows == 0
