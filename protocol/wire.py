"""Every protobuf ⇄ plain-type conversion and the engine-error → gRPC status map, in one place.

Importing this module pulls in neither torch nor numpy (the orchestrator imports it); the
tensor codec imports them when called, on the workers. Context features cross the
orchestrator as ``specdec.v1.Tensor`` messages it never decodes.
"""
from __future__ import annotations

import math
import secrets

import grpc

from protocol.types import (FailedPrecondition, InvalidRequest, Mode, Prefilled, ResourceExhausted, SamplingParams,
                            Unavailable, UnknownRequest, Verified)
from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import common_pb2 as common_v2, draft_pb2, target_pb2

STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnknownRequest: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}
_MODE_V2 = {Mode.AUTOREGRESSIVE: common_v2.MODE_AUTOREGRESSIVE, Mode.CHAIN: common_v2.MODE_CHAIN,
            Mode.TREE: common_v2.MODE_TREE}
_MODE_FROM_V2 = {v: k for k, v in _MODE_V2.items()}


# ---- request messages that do not parse

class Undecodable:
    """Stands for a request message that did not parse (a string field that is not UTF-8, a
    truncated field): ``tolerant`` returns it instead of raising, ``checked`` refuses it."""

    def __init__(self, error: Exception):
        self.details = f"malformed request message (string fields must be valid UTF-8): {error}"


def tolerant(deserializer):
    """Wrap a server handler's request deserializer so that a message that fails to parse
    becomes an ``Undecodable`` (gRPC would end the call with UNKNOWN)."""
    if deserializer is None:
        return None
    from google.protobuf.message import DecodeError

    def decode(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return Undecodable(e)
    return decode


async def checked(request, context: grpc.aio.ServicerContext):
    """The request (a message, or an async iterator of messages for client streams) with
    every ``Undecodable`` refused with INVALID_ARGUMENT."""
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
    if not hasattr(request, "__aiter__"):
        return request

    async def messages():
        async for msg in request:
            if isinstance(msg, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.details)
            yield msg
    return messages()


# ---- sampling params and modes

def sampling_from_proto(msg: common_pb2.SamplingParams, field: str = "sampling",
                        draw_seed: bool = False) -> SamplingParams:
    """Convert; top_p 0 reads as 1.0 (off). A missing seed becomes 0, or a fresh random 64-bit
    seed with ``draw_seed``. Raises InvalidRequest for min_p and the penalties (not supported:
    refused rather than silently ignored)."""
    if msg.min_p != 0:
        raise InvalidRequest(f"{field}.min_p is not supported; it must be 0, got {msg.min_p}")
    if msg.repetition_penalty not in (0.0, 1.0):
        raise InvalidRequest(f"{field}.repetition_penalty is not supported; it must be 0 or 1, "
                             f"got {msg.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(msg, name) != 0:
            raise InvalidRequest(f"{field}.{name} is not supported; it must be 0, got {getattr(msg, name)}")
    # the OS's randomness, not the process's `random` state: a server thread must not draw from (or
    # advance) a generator the embedding program may have seeded
    seed = msg.seed if msg.HasField("seed") else (secrets.randbits(64) if draw_seed else 0)
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0, seed=seed)


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


def mode_from_v2(value: int, field: str = "mode") -> Mode:
    if value not in _MODE_FROM_V2:
        raise InvalidRequest(f"{field} must be AUTOREGRESSIVE, CHAIN or TREE, got {value}")
    return _MODE_FROM_V2[value]


# ---- tensors (workers only: imports torch/numpy when called)

_DTYPES = ("float32", "bfloat16", "float16")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


_TORCH: dict = {}  # dtype name <-> torch dtype, filled on first use (workers only)


def _torch_dtypes() -> dict:
    if not _TORCH:
        import torch
        for name in _DTYPES:
            _TORCH[name] = getattr(torch, name)
            _TORCH[getattr(torch, name)] = name
    return _TORCH


def tensor_to_proto(t, into: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """torch.Tensor → raw little-endian row-major bytes + dtype + shape, written into ``into``
    (a message field, filled in place: no intermediate message) or a new message."""
    name = _torch_dtypes().get(t.dtype)
    if name is None:
        raise ValueError(f"unsupported dtype {t.dtype}")
    if t.requires_grad or not t.is_cpu or not t.is_contiguous():
        t = t.detach().contiguous().cpu()
    if name == "bfloat16":
        import torch
        t = t.view(torch.int16)
    msg = common_pb2.Tensor() if into is None else into
    msg.dtype = name
    msg.shape.extend(t.shape)
    msg.data = t.numpy().tobytes()
    return msg


def tensor_from_proto(msg: common_pb2.Tensor, field: str = "tensor"):
    """Raises InvalidRequest naming ``field`` on an unknown dtype or a size mismatch. One copy
    of the bytes (a writable tensor), no numpy: this runs on the drafter every round."""
    dtype = _torch_dtypes().get(msg.dtype) if msg.dtype in _ITEMSIZE else None
    if dtype is None:
        raise InvalidRequest(f"{field}.dtype must be one of {sorted(_DTYPES)}, got {msg.dtype!r}")
    shape, data = list(msg.shape), msg.data
    n = math.prod(shape)  # Python ints: no overflow
    if n * _ITEMSIZE[msg.dtype] != len(data) or (shape and min(shape) < 0):
        raise InvalidRequest(f"{field}: {len(data)} bytes do not match shape {shape} of {msg.dtype}")
    if shape and max(shape) >= 2 ** 31:  # (an empty tensor of a huge shape: torch cannot size its storage)
        raise InvalidRequest(f"{field}: shape {shape[:8]} has a dimension >= 2**31")
    if n == 0:
        import torch
        return torch.zeros(shape, dtype=dtype)
    import torch
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# ---- target session messages

def target_open(prompt: list[int], max_new_tokens: int, sampling: SamplingParams, mode: Mode,
                tree_budget: int, hold: bool = False) -> target_pb2.TargetMessage:
    """``hold``: the worker keeps the prompt's feature rows (``TargetOpen.hold_features``)."""
    return target_pb2.TargetMessage(open=target_pb2.TargetOpen(
        prompt_tokens=prompt, max_new_tokens=max_new_tokens, sampling=sampling_to_proto(sampling),
        mode=_MODE_V2[mode], tree_budget=tree_budget, hold_features=hold))


def target_verify(tokens: list[int], parents: list[int], commit: list[int] | None,
                  hold: bool = False) -> target_pb2.TargetMessage:
    """``hold``: the worker keeps this round's feature rows (``TargetVerify.hold_features``)."""
    m = target_pb2.TargetMessage()
    _verify_into(m.verify, tokens, parents, commit, hold)
    return m


def _verify_into(v: target_pb2.TargetVerify, tokens: list[int], parents: list[int], commit: list[int] | None,
                 hold: bool = False) -> None:
    if commit:
        v.commit.extend(commit)
    v.tree.tokens.extend(tokens)
    v.tree.parents.extend(parents)
    v.tree.SetInParent()
    if hold:
        v.hold_features = True


def target_step(items: list[tuple]) -> target_pb2.TargetStep:
    """A ``Steps`` message: per request (worker id, tree tokens, tree parents, commit[, hold]) one verify."""
    m = target_pb2.TargetStep()
    for worker_id, tokens, parents, commit, *hold in items:
        it = m.items.add()
        it.worker_id = worker_id
        _verify_into(it.verify, tokens, parents, commit, bool(hold and hold[0]))
    return m


def target_step_reply(results: list) -> target_pb2.TargetStepReply:
    """One ``Steps`` reply: per item its ``Verified`` or an error (gRPC status code, details)."""
    r = target_pb2.TargetStepReply()
    for out in results:
        res = r.results.add()
        if isinstance(out, Verified):
            _verified_into(res.verified, out)
        else:
            res.error.code, res.error.details = out[0].value[0], out[1]
    return r


def step_results(reply, field: str, read) -> list:
    """A ``Steps`` reply's results in item order: ``read(result.<field>)``, or for a failed item its
    (grpc.StatusCode, details) (an unknown code number reads as UNKNOWN)."""
    out = []
    for res in reply.results:
        if res.WhichOneof("kind") == "error":
            out.append((_CODES.get(res.error.code, grpc.StatusCode.UNKNOWN), res.error.details))
        else:
            out.append(read(getattr(res, field)))
    return out


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def opened_to_proto(out: Prefilled) -> target_pb2.TargetReply:
    r = target_pb2.TargetReply()
    r.opened.SetInParent()
    r.opened.first_token = out.first_token
    if out.features is not None:
        tensor_to_proto(out.features, r.opened.context_features)
    return r


def opened_from_proto(r: target_pb2.TargetReply) -> Prefilled:
    o = r.opened
    return Prefilled(o.first_token, o.context_features if o.HasField("context_features") else None)


def verified_to_proto(out: Verified) -> target_pb2.TargetReply:
    """Filled in place (no intermediate messages: this runs on the target every round)."""
    r = target_pb2.TargetReply()
    _verified_into(r.verified, out)
    return r


def _verified_into(v: target_pb2.TargetVerified, out: Verified) -> None:
    v.SetInParent()
    v.samples.extend(out.samples)
    v.edge_probs.extend(out.edge_probs)
    v.feature_nodes.extend(out.feature_nodes)
    if out.features is not None:
        tensor_to_proto(out.features, v.context_features)
    if out.held_rows:
        v.held_rows = out.held_rows


def verified_from_proto(r: target_pb2.TargetReply) -> Verified:
    return verified_from(r.verified)


def verified_from(v: target_pb2.TargetVerified) -> Verified:
    """The repeated fields as lists (a full slice: one C copy, ~2x faster than ``list()``)."""
    return Verified(v.samples[:], v.edge_probs[:], v.feature_nodes[:],
                    v.context_features if v.HasField("context_features") else None, v.held_rows)


# ---- draft session messages

def draft_message(features, context_start: int, bonus: int, mode: Mode | None = None,
                  tree_budget: int = 0, round_budget: int | None = None) -> draft_pb2.DraftMessage:
    """``features``: the target's ``Tensor`` message, forwarded untouched. ``mode`` only on the
    request's first message (binds mode and tree budget). ``round_budget``: this round's tree
    budget (tree mode, <= the bound one; None = the bound budget, sent as 0)."""
    msg = draft_pb2.DraftMessage(context_features=features, context_start=context_start, bonus_token=bonus,
                                 round_budget=round_budget or 0)
    if mode is not None:
        msg.open.CopyFrom(draft_pb2.DraftOpen(mode=_MODE_V2[mode], tree_budget=tree_budget))
    return msg


def draft_step(items: list[tuple[str, object, int, int, int | None]]) -> draft_pb2.DraftStep:
    """A ``Steps`` message: per request (worker id, features ``Tensor``, context_start, bonus,
    round_budget or None) one draft message — never a request's first (it binds the mode)."""
    m = draft_pb2.DraftStep()
    for worker_id, features, context_start, bonus, round_budget in items:
        it = m.items.add()
        it.worker_id = worker_id
        d = it.draft
        d.context_features.CopyFrom(features)
        d.context_start, d.bonus_token, d.round_budget = context_start, bonus, round_budget or 0
    return m


def draft_step_reply(results: list) -> draft_pb2.DraftStepReply:
    """One ``Steps`` reply: per item its (tokens, parents) or an error (gRPC status code, details)."""
    r = draft_pb2.DraftStepReply()
    for out in results:
        res = r.results.add()
        if isinstance(out[0], grpc.StatusCode):
            res.error.code, res.error.details = out[0].value[0], out[1]
        else:
            _tree_into(res.tree, *out)
    return r


def round_budget_from_proto(msg: draft_pb2.DraftMessage) -> int | None:
    """A draft message's ``round_budget``: None for 0 (the budget bound at open), else the value.
    Raises InvalidRequest naming ``round_budget`` when it is negative; the upper bound (the
    bound budget) is the draft engine's check."""
    if msg.round_budget < 0:
        raise InvalidRequest(f"round_budget must be >= 1 (0 = the tree budget bound at open), got {msg.round_budget}")
    return msg.round_budget or None


def draft_reply(tokens: list[int], parents: list[int]) -> draft_pb2.DraftReply:
    r = draft_pb2.DraftReply()
    _tree_into(r, tokens, parents)
    return r


def _tree_into(r: draft_pb2.DraftReply, tokens: list[int], parents: list[int]) -> None:
    r.tree.tokens.extend(tokens)
    r.tree.parents.extend(parents)
    r.tree.SetInParent()
