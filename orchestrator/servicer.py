"""gRPC servicer for the public specdec.v1.Orchestrator API."""
from __future__ import annotations

import asyncio

import time
import uuid
from dataclasses import dataclass

import grpc
import structlog

from modeling.tokenizer import TextTokenizer
from orchestrator.adaptive import use_metrics
from orchestrator.generation import Delta, GenerationRequest, generate
from orchestrator.metered import MeteredDraft, MeteredTarget, record_finished
from protocol.types import FailedPrecondition, InvalidRequest, Mode
from protocol.wire import sampling_from_proto
from serving import metrics
from serving.logs import bind_request
from specdec_proto.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = structlog.get_logger()
_POLICIES = {orchestrator_pb2.BUDGET_POLICY_FIXED: "fixed", orchestrator_pb2.BUDGET_POLICY_ADAPTIVE: "adaptive"}
_MODES = {orchestrator_pb2.MODE_UNSPECIFIED: Mode.TREE, orchestrator_pb2.MODE_AUTOREGRESSIVE: Mode.AUTOREGRESSIVE,
          orchestrator_pb2.MODE_CHAIN: Mode.CHAIN, orchestrator_pb2.MODE_TREE: Mode.TREE}


@dataclass
class Limits:
    max_context: int
    max_tokens: int
    max_tree_budget: int
    default_tree_budget: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_stop: int = 16
    max_stop_chars: int = 256
    budget_policy: str = "fixed"  # a tree request's policy when it names none (--tree-budget-policy)


#: Text or chat prompts longer than this many characters per max_context token are refused
#: before tokenization (a real prompt averages ~4 characters per token).
MAX_CHARS_PER_TOKEN = 32


def build_request(msg: orchestrator_pb2.GenerateRequest, tok: TextTokenizer, lim: Limits) -> GenerationRequest:
    """Validate a GenerateRequest and turn it into engine terms. Raises InvalidRequest naming the
    field and the limit; FailedPrecondition for a chat prompt the model cannot render (no chat template,
    or one that fails to compile or render: its fault, not the messages')."""
    rid = msg.request_id
    if len(rid) > 128 or not (rid.isascii() and rid.isprintable()):  # it travels as gRPC metadata to the workers
        raise InvalidRequest("request_id must be at most 128 printable ASCII characters")
    kind = msg.WhichOneof("prompt")
    chars = len(msg.text) if kind == "text" else sum(len(m.content) for m in msg.chat.messages)
    if chars > MAX_CHARS_PER_TOKEN * lim.max_context:  # refuse before paying to tokenize it
        raise InvalidRequest(f"prompt ({kind}) has {chars} characters; at most {MAX_CHARS_PER_TOKEN} × max_context "
                             f"({MAX_CHARS_PER_TOKEN * lim.max_context}) are accepted")
    if kind == "text":
        prompt = tok.encode(msg.text)
    elif kind == "chat":
        if not msg.chat.messages:
            raise InvalidRequest("chat.messages must not be empty")
        roles = {m.role for m in msg.chat.messages} - {"system", "user", "assistant"}
        if roles:
            raise InvalidRequest(f"chat.messages role must be system, user or assistant, got {sorted(roles)[0]!r}")
        if not tok.chat_template:
            raise FailedPrecondition("chat: this model has no chat template; send text or token_ids")
        try:
            text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msg.chat.messages])
        except ValueError as e:  # the template refused these messages: the request's to change
            raise InvalidRequest(f"chat.messages: {e}") from e
        except RuntimeError as e:  # the model's template is broken: the server's
            raise FailedPrecondition(f"chat: {e}; send text or token_ids") from e
        prompt = tok.encode(text)
    elif kind == "token_ids":
        prompt = list(msg.token_ids.ids)
        bad = [t for t in prompt if not 0 <= t < lim.vocab_size]
        if bad:
            raise InvalidRequest(f"token_ids.ids must be in [0, {lim.vocab_size}), got {bad[0]}")
    else:
        raise InvalidRequest("prompt is required: set text, chat or token_ids")
    if not prompt:
        raise InvalidRequest(f"prompt ({kind}) must not be empty")
    if len(prompt) >= lim.max_context:
        raise InvalidRequest(f"prompt has {len(prompt)} tokens; it must be shorter than max_context {lim.max_context}")
    if not 1 <= msg.max_tokens <= lim.max_tokens:
        raise InvalidRequest(f"max_tokens must be in [1, {lim.max_tokens}], got {msg.max_tokens}")
    if len(prompt) + msg.max_tokens > lim.max_context:
        raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({msg.max_tokens}) must be <= "
                             f"max_context {lim.max_context}")
    if msg.mode not in _MODES:
        raise InvalidRequest(f"mode must be one of AUTOREGRESSIVE, CHAIN, TREE, got {msg.mode}")
    if msg.budget_policy not in _POLICIES and msg.budget_policy != orchestrator_pb2.BUDGET_POLICY_UNSPECIFIED:
        raise InvalidRequest(f"budget_policy must be one of BUDGET_POLICY_FIXED, BUDGET_POLICY_ADAPTIVE "
                             f"(0 = the server's), got {msg.budget_policy}")
    policy = _POLICIES.get(msg.budget_policy, lim.budget_policy)
    if msg.budget_policy == orchestrator_pb2.BUDGET_POLICY_ADAPTIVE and _MODES[msg.mode] is not Mode.TREE:
        raise InvalidRequest(f"budget_policy BUDGET_POLICY_ADAPTIVE needs mode TREE, got "
                             f"{orchestrator_pb2.Mode.Name(msg.mode)}")
    tree_budget = msg.tree_budget or lim.default_tree_budget
    if not 1 <= tree_budget <= lim.max_tree_budget:
        raise InvalidRequest(f"tree_budget must be in [1, {lim.max_tree_budget}] (0 = default), got {msg.tree_budget}")
    if len(msg.stop) > lim.max_stop or any(not s or len(s) > lim.max_stop_chars for s in msg.stop):
        raise InvalidRequest(f"stop must hold at most {lim.max_stop} non-empty strings of at most "
                             f"{lim.max_stop_chars} characters")
    bad = [t for t in msg.stop_token_ids if not 0 <= t < lim.vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids must be in [0, {lim.vocab_size}), got {bad[0]}")
    sampling = sampling_from_proto(msg.sampling, draw_seed=True)
    sampling.validate(lim.vocab_size)
    stop_ids = set(msg.stop_token_ids) | (set() if msg.ignore_eos else set(lim.eos_token_ids))
    return GenerationRequest(request_id=msg.request_id or uuid.uuid4().hex, prompt_tokens=prompt,
                             max_tokens=msg.max_tokens, mode=_MODES[msg.mode], tree_budget=tree_budget,
                             stop=list(msg.stop), stop_token_ids=stop_ids, sampling=sampling, budget_policy=policy)


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """Generate, with its Prometheus metrics (``serving.metrics``): outcome, tokens, TTFT,
    inter-token latency, e2e latency, per-round calls and spec-decode counters. Every request
    logs one end line: "finished" (with its stats) or "ended" (outcome: the status code, e.g.
    CANCELLED when the client went away, DEADLINE_EXCEEDED when its deadline passed)."""

    def __init__(self, state: dict):
        self.state = state  # tokenizer, limits, target, draft, planner once connected
        metrics.use_orchestrator()
        use_metrics()

    async def Generate(self, request, context):
        arrived = time.perf_counter()
        outcome = "CANCELLED"  # unless it finishes or fails with a status
        sent = 0  # tokens streamed to the client

        async def fail(code: grpc.StatusCode, details: str):
            nonlocal outcome
            outcome = code.name
            await context.abort(code, details)

        metrics.RUNNING.inc()
        try:
            if "limits" not in self.state:
                await fail(grpc.StatusCode.UNAVAILABLE, "orchestrator is starting")
            if not self.state.get("target_ready", True):
                await fail(grpc.StatusCode.UNAVAILABLE, "target service is not ready (health check failing)")
            tok: TextTokenizer = self.state["tokenizer"]
            try:
                # off the event loop: tokenizing a long prompt must not stall health checks and streams
                req = await asyncio.to_thread(build_request, request, tok, self.state["limits"])
            except InvalidRequest as e:
                await fail(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except FailedPrecondition as e:
                await fail(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            left = context.time_remaining()  # the client's deadline, passed on to both workers
            req.deadline = None if left is None else time.monotonic() + left
            bind_request(req.request_id)
            log.info("generate", mode=req.mode, prompt_tokens=len(req.prompt_tokens), max_tokens=req.max_tokens,
                     **({"budget_policy": req.budget_policy} if req.mode is Mode.TREE else {}))
            metrics.PROMPT_TOKENS.inc(len(req.prompt_tokens))
            target, draft = MeteredTarget(self.state["target"]), MeteredDraft(self.state["draft"])
            last = None
            try:
                async for event in generate(req, tok, target, draft, self.state["draft_health"],
                                            self.state.get("planner")):
                    if isinstance(event, Delta):
                        now = time.perf_counter()
                        (metrics.ITL if last else metrics.TTFT).observe(now - (last or arrived))
                        last = now
                        metrics.GENERATION_TOKENS.inc(len(event.token_ids))
                        sent += len(event.token_ids)
                        yield orchestrator_pb2.GenerateResponse(
                            delta=orchestrator_pb2.TextDelta(text=event.text, token_ids=event.token_ids))
                        continue
                    st = event.stats
                    log.info("finished", reason=event.finish_reason, tokens=event.completion_tokens,
                             rounds=st.rounds, tau=round(st.mean_accept_length, 3), fallback_rounds=st.fallback_rounds)
                    record_finished(st, req.mode.speculative)
                    outcome = event.finish_reason
                    yield orchestrator_pb2.GenerateResponse(final=orchestrator_pb2.Final(
                        finish_reason=event.finish_reason, request_id=req.request_id,
                        usage=orchestrator_pb2.Usage(prompt_tokens=event.prompt_tokens,
                                                     completion_tokens=event.completion_tokens),
                        stats=orchestrator_pb2.SpecStats(
                            rounds=st.rounds, mean_accept_length=st.mean_accept_length,
                            accept_length_histogram=st.histogram, expected_accept_length=st.expected_accept_length,
                            draft_seconds=st.draft_seconds, verify_seconds=st.verify_seconds,
                            fallback_rounds=st.fallback_rounds)))
            except grpc.aio.AioRpcError as e:  # a worker's status passes through (details name the worker)
                log.warning("worker error", code=str(e.code()), details=e.details())
                await fail(e.code(), e.details())
        except Exception:
            if outcome == "CANCELLED":  # not a status we chose: a bug (the client sees UNKNOWN)
                outcome = "UNKNOWN"
            raise
        finally:
            if outcome == "CANCELLED":  # gRPC ended the handler: the client went away, or its deadline passed
                # (the client's own timer fires first and cancels: here the deadline, which started
                # when the request arrived, is then a little ahead)
                left = context.time_remaining()
                outcome = "DEADLINE_EXCEEDED" if left is not None and left < 0.25 else outcome
            if outcome.isupper():  # a status code, not a finish reason
                log.info("ended", outcome=outcome, tokens=sent, seconds=round(time.perf_counter() - arrived, 3))
            metrics.RUNNING.dec()
            metrics.REQUESTS.labels(outcome).inc()
            metrics.E2E.observe(time.perf_counter() - arrived)
