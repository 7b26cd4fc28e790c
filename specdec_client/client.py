"""Typed clients: ``SpecDecClient`` (blocking) and ``AsyncSpecDecClient`` (asyncio).

``generate()`` returns a ``GenerationResult``; ``stream()`` yields ``Chunk``s and, last, the
``GenerationResult``. gRPC failures raise ``SpecDecError`` carrying the status code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import grpc

from serving.security import bearer, channel_credentials, secure_or_insecure
from specdec_proto.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

_MODES = {"autoregressive": orchestrator_pb2.MODE_AUTOREGRESSIVE, "chain": orchestrator_pb2.MODE_CHAIN,
          "tree": orchestrator_pb2.MODE_TREE}
_POLICIES = {"": orchestrator_pb2.BUDGET_POLICY_UNSPECIFIED, "fixed": orchestrator_pb2.BUDGET_POLICY_FIXED,
             "adaptive": orchestrator_pb2.BUDGET_POLICY_ADAPTIVE}


class SpecDecError(Exception):
    """A failed call. ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


@dataclass
class Chunk:
    text: str
    token_ids: list[int]


@dataclass
class SpecStats:
    rounds: int
    mean_accept_length: float
    accept_length_histogram: list[int]
    expected_accept_length: float
    draft_seconds: float
    verify_seconds: float
    fallback_rounds: int = 0  # one-token rounds because the draft service was down, failed or too slow


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats
    request_id: str = ""
    chunks: int = field(default=0, repr=False)


def build_request(prompt: str | None = None, *, messages: list[dict] | None = None,
                  token_ids: list[int] | None = None, max_tokens: int = 64, mode: str = "tree",
                  tree_budget: int = 0, stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
                  ignore_eos: bool = False, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None, request_id: str = "",
                  budget_policy: str = "") -> orchestrator_pb2.GenerateRequest:
    """Exactly one of prompt (text), messages ([{role, content}]) or token_ids. mode:
    autoregressive | chain | tree. budget_policy (tree mode): "" = the server's, "fixed"
    (tree_budget nodes every round) or "adaptive" (per round a one-token round or a tree of at
    most tree_budget nodes, the server's choice; same output). Raises ValueError on an unknown
    mode or policy, or several prompts."""
    if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages, token_ids")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    if budget_policy not in _POLICIES:
        raise ValueError(f"budget_policy must be one of {sorted(_POLICIES)}, got {budget_policy!r}")
    req = orchestrator_pb2.GenerateRequest(
        max_tokens=max_tokens, mode=_MODES[mode], tree_budget=tree_budget, stop=stop or [],
        stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos, request_id=request_id,
        budget_policy=_POLICIES[budget_policy],
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
    if prompt is not None:
        req.text = prompt
    elif messages is not None:
        req.chat.messages.extend(orchestrator_pb2.ChatMessage(**m) for m in messages)
    else:
        req.token_ids.ids.extend(token_ids)
    return req


class _Assembler:
    def __init__(self):
        self.text, self.ids, self.n = [], [], 0

    def add(self, msg: orchestrator_pb2.GenerateResponse) -> Chunk | GenerationResult:
        if msg.WhichOneof("event") == "delta":
            self.text.append(msg.delta.text)
            self.ids.extend(msg.delta.token_ids)
            self.n += 1
            return Chunk(msg.delta.text, list(msg.delta.token_ids))
        f, s = msg.final, msg.final.stats
        return GenerationResult(
            "".join(self.text), self.ids, f.finish_reason, f.usage.prompt_tokens, f.usage.completion_tokens,
            SpecStats(s.rounds, s.mean_accept_length, list(s.accept_length_histogram), s.expected_accept_length,
                      s.draft_seconds, s.verify_seconds, s.fallback_rounds), f.request_id, self.n)


def _options(max_message_mb: int):
    n = max_message_mb * 2 ** 20
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


class SpecDecClient:
    """Blocking client. ``address`` like "127.0.0.1:50051"; use as a context manager or close().

    Security (off by default; README "TLS and tokens"): ``tls_ca`` (PEM file: the CA that signed
    the server's certificate) or ``tls=True`` (the system's roots) turn TLS on; ``tls_cert`` /
    ``tls_key`` present a client certificate (mutual TLS); ``token`` is sent as
    ``authorization: Bearer <token>`` on every call (a server with ``--auth-token`` refuses calls
    without it: UNAUTHENTICATED)."""

    def __init__(self, address: str, timeout: float | None = None, max_message_mb: int = 64, *,
                 tls: bool = False, tls_ca: str = "", tls_cert: str = "", tls_key: str = "", token: str = ""):
        self.channel = secure_or_insecure(False, address, channel_credentials(tls_ca, tls_cert, tls_key, tls),
                                          options=_options(max_message_mb))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.timeout, self.metadata = timeout, bearer(token)

    def stream(self, prompt: str | None = None, **kw) -> Iterator[Chunk | GenerationResult]:
        """Yield Chunks as they arrive, then the GenerationResult. Raises SpecDecError."""
        asm = _Assembler()
        try:
            for msg in self.stub.Generate(build_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata):
                yield asm.add(msg)
        except grpc.RpcError as e:
            raise SpecDecError(e.code(), e.details()) from None

    def generate(self, prompt: str | None = None, **kw) -> GenerationResult:
        """Run to completion. Same arguments as ``build_request``. Raises SpecDecError."""
        *_, result = self.stream(prompt, **kw)
        return result

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncSpecDecClient:
    """asyncio client; same API (and security arguments) as SpecDecClient with ``await`` /
    ``async for``."""

    def __init__(self, address: str, timeout: float | None = None, max_message_mb: int = 64, *,
                 tls: bool = False, tls_ca: str = "", tls_cert: str = "", tls_key: str = "", token: str = ""):
        self.channel = secure_or_insecure(True, address, channel_credentials(tls_ca, tls_cert, tls_key, tls),
                                          options=_options(max_message_mb))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.timeout, self.metadata = timeout, bearer(token)

    async def stream(self, prompt: str | None = None, **kw) -> AsyncIterator[Chunk | GenerationResult]:
        """Yield Chunks as they arrive, then the GenerationResult. Raises SpecDecError. Leaving
        early (``aclose()``, ``break``, an error in the caller's loop) cancels the request."""
        asm = _Assembler()
        call = self.stub.Generate(build_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)
        try:
            async for msg in call:
                yield asm.add(msg)
        except grpc.aio.AioRpcError as e:
            raise SpecDecError(e.code(), e.details()) from None
        finally:
            call.cancel()  # no-op once the RPC has finished

    async def generate(self, prompt: str | None = None, **kw) -> GenerationResult:
        result = None
        async for result in self.stream(prompt, **kw):
            pass
        return result

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
