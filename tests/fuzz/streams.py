"""A blocking client for one worker ``Session`` stream that sends raw bytes (so a test can send
messages that do not parse) and bounds the whole stream by a deadline."""
from __future__ import annotations

import queue

import grpc


class RawSession:
    """``send(msg)`` writes a message (a protobuf message or raw bytes) and returns its reply,
    parsed with ``reply_type``; a refusal raises ``grpc.RpcError``. ``close()`` ends the stream
    as a client that is done; ``cancel()`` as one that gave up."""

    open: list["RawSession"] = []  # every session not yet ended (``end_all``)

    def __init__(self, channel: grpc.Channel, method: str, reply_type, worker_id: str, timeout: float):
        RawSession.open.append(self)
        self._q: queue.Queue = queue.Queue()
        call = channel.stream_stream(method, request_serializer=lambda b: b,
                                     response_deserializer=reply_type.FromString)
        self._call = call(iter(self._q.get, None), metadata=(("x-worker-id", worker_id), ("x-request-id", "fuzz")),
                          timeout=timeout)

    def send(self, msg):
        self._q.put(msg if isinstance(msg, bytes) else msg.SerializeToString())
        return next(self._call)

    def close(self) -> None:
        self._q.put(None)
        for _ in self._call:
            pass

    def cancel(self) -> None:
        self._call.cancel()
        self._q.put(None)

    @classmethod
    def end_all(cls) -> None:
        """Cancel every session still open: a case that stops part-way (a failed assertion, or
        hypothesis ending an example whose draws ran out) must not leave a live stream behind."""
        while cls.open:
            cls.open.pop().cancel()


def code_of(fn):
    """(status code, details, result) of calling ``fn``; OK and the result when it returns."""
    try:
        return grpc.StatusCode.OK, "", fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


def run_leak_checked(lb, session, worker: str) -> None:
    """Run one fuzz case (``session()``), end every raw stream it left open, then check that the
    worker holds nothing beyond the canary's one request (``lb``: the fuzz Loopback)."""
    try:
        session()
    finally:
        RawSession.end_all()
    assert max(lb.wait_at_most(1)) <= 1, (f"{worker} state leaked (the canary holds at most one request)", lb.held())
