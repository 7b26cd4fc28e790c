"""Bad input gets INVALID_ARGUMENT naming the field and the limit; the services keep serving."""
import grpc
import pytest

from specdec_client import SpecDecError
from specdec_proto.v1 import orchestrator_pb2, orchestrator_pb2_grpc

CASES = [
    (dict(prompt=""), "prompt"),
    (dict(token_ids=[]), "prompt"),
    (dict(prompt="word " * 9000), "max_context"),
    (dict(prompt="x" * (32 * 8192 + 1)), "characters"),  # refused before tokenizing
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens"),
    (dict(prompt="hi", max_tokens=10 ** 6), "max_tokens"),
    (dict(prompt="hi", tree_budget=100000), "tree_budget"),
    (dict(prompt="hi", tree_budget=-1), "tree_budget"),
    (dict(token_ids=[1, 10 ** 6]), "token_ids"),
    (dict(prompt="hi", stop_token_ids=[-5]), "stop_token_ids"),
    (dict(prompt="hi", stop=[""]), "stop"),
    (dict(messages=[]), "messages"),
]


@pytest.mark.parametrize("kwargs,field", CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
def test_invalid_argument(client, kwargs, field):
    kwargs.setdefault("max_tokens", 8)
    with pytest.raises(SpecDecError) as e:
        client.generate(**kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details


def test_unknown_mode_and_missing_prompt(stack):
    with grpc.insecure_channel(stack.address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        for req, field in [(orchestrator_pb2.GenerateRequest(text="hi", max_tokens=4, mode=42), "mode"),
                           (orchestrator_pb2.GenerateRequest(max_tokens=4), "prompt")]:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_still_serving_after_errors(client):
    r = client.generate(prompt="The capital of France is", max_tokens=8, mode="tree", tree_budget=8)
    assert r.completion_tokens == 8 or r.finish_reason == "stop"


def test_worker_session_errors(stack):
    """The target session refuses a verify before open (FAILED_PRECONDITION), an open over its
    limits (INVALID_ARGUMENT naming the field), a bad tree (INVALID_ARGUMENT); a failed session
    keeps nothing; a refused open neither poisons its id nor, as a duplicate, frees the live
    session with that id."""
    from sessions import Session, live
    from specdec_proto.v1 import common_pb2
    from specdec_proto.v2 import common_pb2 as v2, target_pb2, target_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['target']}") as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        verify = target_pb2.TargetMessage(verify=target_pb2.TargetVerify(tree=common_pb2.TokenTree(tokens=[1], parents=[-1])))
        with pytest.raises(grpc.RpcError) as e:
            Session(stub, "t0").send(verify)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            Session(stub, "t1").send(target_pb2.TargetMessage(open=target_pb2.TargetOpen(
                prompt_tokens=[1], max_new_tokens=10 ** 7, mode=v2.MODE_AUTOREGRESSIVE)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in e.value.details()
        s = Session(stub, "t1")  # the id whose open was just refused is still usable
        opening = target_pb2.TargetMessage(open=target_pb2.TargetOpen(
            prompt_tokens=[1, 2, 3], max_new_tokens=4, mode=v2.MODE_TREE, tree_budget=4))
        first = s.send(opening).opened.first_token
        assert live(stack)[0] == 1
        with pytest.raises(grpc.RpcError) as e:
            Session(stub, "t1").send(opening)  # a second session on a live id
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already live" in e.value.details()
        assert live(stack)[0] == 1  # the refused duplicate freed nothing
        with pytest.raises(grpc.RpcError) as e:
            s.send(target_pb2.TargetMessage(verify=target_pb2.TargetVerify(
                tree=common_pb2.TokenTree(tokens=[first, 5, 6], parents=[-1, 0, 5]))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parents" in e.value.details()
    assert live(stack) == (0, 0, 0)


def test_request_id_and_roles_validated(client):
    for kwargs, field in [(dict(prompt="hi", request_id="x" * 200), "request_id"),
                          (dict(prompt="hi", request_id="a\nb"), "request_id"),
                          (dict(messages=[{"role": "wizard", "content": "hi"}]), "role")]:
        with pytest.raises(SpecDecError) as e:
            client.generate(max_tokens=4, **kwargs)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details


def test_reused_request_id_does_not_interfere(client):
    from concurrent.futures import ThreadPoolExecutor

    args = dict(prompt="Count: one, two,", max_tokens=12, mode="tree", tree_budget=4, request_id="same-id")
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: client.generate(**args), range(2)))
    assert results[0].token_ids == results[1].token_ids and results[0].request_id == "same-id"


BAD = [(dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
       (dict(temperature=0.7, top_p=1.5), "top_p"), (dict(temperature=0.7, top_p=-0.1), "top_p"),
       (dict(temperature=0.7, top_k=-1), "top_k")]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f"{f}{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_sampling_params_are_refused(client, kwargs, field):
    with pytest.raises(SpecDecError) as e:
        client.generate(prompt="hi", max_tokens=4, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in e.value.details


@pytest.mark.parametrize("field", ["min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"])
def test_unsupported_sampling_options_are_refused(stack, field):
    """Not in the SDK's arguments, so sent as a raw request: refused, never silently ignored."""
    from specdec_client.client import build_request

    req = build_request("hi", max_tokens=4, temperature=0.7, seed=1)
    setattr(req.sampling, field, 0.5)
    with grpc.insecure_channel(stack.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in e.value.details()
