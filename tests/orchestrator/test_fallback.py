"""Draft-service failure inside the round loop (in process, real engines): a drafter that
raises, or misses the round deadline, turns rounds into one-token rounds without changing a
token (greedy and seeded); once it is healthy again a new draft session opens, seeded with the
kept feature rows, and speculation resumes. Also the two pieces on their own: the bounded
feature tail (opaque ``Tensor`` messages cut and joined as bytes) and the shared circuit
breaker (one warning per outage, one probe at a time with backoff).

The real-process versions (kill the draft service mid-generation) are in
tests/deploy/test_reliability.py."""
import asyncio

import numpy as np
import pytest
import structlog

from deploy.inprocess import InProcessDraft
from modeling.sampling import SamplingParams
from orchestrator.fallback import DraftHealth
from orchestrator.features import FeatureTail
from orchestrator.generation import GenerationRequest
from specdec_proto.v1 import common_pb2

PROMPT = "Write a short story about a robot who learns to paint."


class FlakyDraft(InProcessDraft):
    """The real draft engine; draft calls numbered in ``fail`` raise, those in ``slow`` sleep
    for ``delay`` s first. ``calls`` records (session id, context_start, feature rows, ok)."""

    def __init__(self, engine, fail=(), slow=(), delay=0.0):
        super().__init__(engine)
        self.fail, self.slow, self.delay, self.calls = set(fail), set(slow), delay, []

    async def draft(self, request_id, features, context_start, bonus, mode, tree_budget, timeout=None):
        n = len(self.calls)
        self.calls.append((request_id, context_start, int(features.shape[0]), n not in self.fail))
        if n in self.slow:
            await asyncio.sleep(self.delay)
        if n in self.fail:
            raise ConnectionError("draft service gone")
        return await super().draft(request_id, features, context_start, bonus, mode, tree_budget)


N = 16  # tokens per generation
SEEDED = SamplingParams(temperature=0.8, seed=1234)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on the shared 2-core machine two threads per process made these
    generations ~10x slower under load."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))


@pytest.fixture(scope="module")
def plain(inprocess, tokenizer, prompt):
    """Autoregressive output by sampling params (greedy, seeded), computed when first asked:
    what every fallback run must reproduce."""
    cache = {}

    def get(sampling=SamplingParams()):
        if sampling not in cache:
            cache[sampling] = run(inprocess, tokenizer, prompt, "autoregressive", sampling=sampling)[0]
        return cache[sampling]

    return get


def run(inprocess, tokenizer, prompt, mode, draft=None, health=None, sampling=SamplingParams(), n=N):
    target, real = inprocess
    req = GenerationRequest("fallback", prompt, n, mode=mode, tree_budget=8, sampling=sampling)
    return asyncio.run(_collect(req, tokenizer, target, draft or real, health))


async def _collect(req, tokenizer, target, draft, health):
    from orchestrator.generation import generate

    ids, final = [], None
    async for ev in generate(req, tokenizer, target, draft, health):
        if hasattr(ev, "token_ids"):
            ids += ev.token_ids
        else:
            final = ev
    return ids, final


@pytest.mark.slow
@pytest.mark.parametrize("mode,sampling", [("tree", SamplingParams()), ("chain", SEEDED)],
                         ids=["greedy-tree", "seeded-chain"])
def test_failed_drafts_fall_back_losslessly_and_speculation_resumes(inprocess, engines, tokenizer, prompt, plain,
                                                                     mode, sampling):
    flaky = FlakyDraft(engines[1], fail={1})
    with structlog.testing.capture_logs() as logs:  # rounds take ~0.1 s here: a few fall back
        ids, final = run(inprocess, tokenizer, prompt, mode, flaky, DraftHealth(min_backoff=0.2), sampling)
    assert ids == plain(sampling)  # token for token (greedy) and seed for seed (sampled)
    st = final.stats
    assert st.fallback_rounds >= 1 and st.rounds == sum(st.histogram)
    sessions = list(dict.fromkeys(c[0] for c in flaky.calls))
    assert len(sessions) >= 2, "no new draft session after the failure"
    reopened = [c for c in flaky.calls if c[0] == sessions[-1]]
    assert reopened[0][1] == 0 and reopened[0][2] > len(prompt)  # all rows kept (256 > this request's length)
    assert len(reopened) >= 2 and all(ok for *_, ok in reopened)  # drafting again after the outage
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "draft service failed: speculation off, requests go on with one-token rounds"]  # once, not per round
    assert engines[1].live_requests == 0 and engines[0].live_requests == 0


def test_slow_draft_misses_the_round_deadline_and_a_new_session_resumes(inprocess, engines, tokenizer, prompt,
                                                                         plain):
    """A draft slower than the round deadline: that round falls back, the session is dropped,
    and a new one opens fed the kept rows — about ``replay_rows`` (8 here, at most 2 × 8), not
    the whole prompt — and drafts the rest of the request."""
    flaky = FlakyDraft(engines[1], slow={1}, delay=5.0)
    health = DraftHealth(round_timeout=0.5, min_backoff=0.0, replay_rows=8)
    ids, final = run(inprocess, tokenizer, prompt, "tree", flaky, health)
    assert ids == plain() and final.stats.fallback_rounds >= 1 and health.outages == 1
    sessions = list(dict.fromkeys(c[0] for c in flaky.calls))
    assert len(sessions) == 2  # the timed-out session was dropped, a new one opened
    first = flaky.calls[0]
    assert first[1] == 0 and first[2] == len(prompt)  # the first session sees the whole prompt, as always
    reopened = [c for c in flaky.calls if c[0] == sessions[1]]
    assert reopened[0][1] == 0 and 1 <= reopened[0][2] <= 16
    assert len(reopened) >= 2 and reopened[1][1] == reopened[0][2]  # then grows from there
    assert final.stats.rounds < len(ids) - 1  # multi-token rounds: speculation went on



def test_a_full_drafter_costs_only_that_request_its_drafts(inprocess, engines, tokenizer, prompt, plain):
    """The real draft engine at its max_requests refuses the request's first draft with
    ResourceExhausted: that request goes on with one-token rounds to its end, token for token,
    and no outage is declared (other requests keep drafting)."""
    drafter = engines[1]
    before = drafter.max_requests
    drafter.max_requests = drafter.live_requests  # full
    try:
        health = DraftHealth(min_backoff=0.0)
        with structlog.testing.capture_logs() as logs:
            ids, final = run(inprocess, tokenizer, prompt, "tree", drafter_client(inprocess), health)
    finally:
        drafter.max_requests = before
    assert ids == plain() and health.outages == 0 and health.up
    assert final.stats.fallback_rounds == final.stats.rounds == len(ids) - 1  # one-token rounds to the end
    assert any(e["event"].startswith("drafter full") for e in logs)
    assert drafter.live_requests == 0 and engines[0].live_requests == 0


def drafter_client(inprocess):
    return inprocess[1]

def message(a: np.ndarray) -> common_pb2.Tensor:
    return common_pb2.Tensor(dtype="float32", shape=list(a.shape), data=a.astype(np.float32).tobytes())


def decode(m: common_pb2.Tensor) -> np.ndarray:
    return np.frombuffer(m.data, np.float32).reshape(list(m.shape))


def test_feature_tail_cuts_and_joins_messages_as_rows():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 6)) for n in (40, 3, 1, 5, 2, 7)]
    tail = FeatureTail(keep=10)
    for i, p in enumerate(parts):
        tail.add(message(p))
        assert tail.rows <= max(20, len(p))  # bounded by 2 × keep (or the newest part)
        whole = np.concatenate(parts[:i + 1])
        for n in range(1, tail.rows + 1):
            assert np.array_equal(decode(tail.last(n)), whole[-n:].astype(np.float32))
    assert tail.last(len(parts[-1])) is not None
    with pytest.raises(ValueError):
        tail.last(tail.rows + 1)
    first = FeatureTail(keep=10)
    first.add(message(parts[0]))
    assert first.last(40).data == message(parts[0]).data  # the newest part is kept whole


def test_one_warning_per_outage_and_probes_back_off():
    async def scenario():
        ready = {"now": False, "probes": 0}

        async def probe():
            ready["probes"] += 1
            return ready["now"]

        h = DraftHealth(probe, min_backoff=0.05, max_backoff=0.2)
        with structlog.testing.capture_logs() as logs:
            for _ in range(5):  # five requests see the same outage
                h.failed(h.epoch, "UNAVAILABLE")
            assert not await h.usable()
            for _ in range(40):  # 0.4 s of rounds asking for the drafter
                await h.usable()
                await asyncio.sleep(0.01)
            probes_while_down = ready["probes"]
            ready["now"] = True
            while not await h.usable():
                await asyncio.sleep(0.01)
            h.failed(h.epoch - 1, "a stale session's error")  # from before the recovery: ignored
            assert await h.usable()
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert len(warnings) == 1 and h.outages == 1
        assert 2 <= probes_while_down <= 5  # backoff 0.05, 0.1, 0.2, 0.2 …: not one per round
        assert [e["event"] for e in logs if e["log_level"] == "info"] == [
            "draft service ready again: speculation resumes"]

    asyncio.run(scenario())


def test_check_now_ends_the_outage_and_logs_it_as_the_process():
    """The readiness follower's ``check_now`` ends an outage once its probe is due (without a
    request having to start it), keeps the backoff, and the resume line carries no request id
    even when a request's round started the probe."""
    from structlog.contextvars import bind_contextvars, clear_contextvars, merge_contextvars

    async def scenario():
        ready = {"now": False}

        async def probe():
            await asyncio.sleep(0.05)
            return ready["now"]

        h = DraftHealth(probe, min_backoff=60, max_backoff=60)
        h.failed(h.epoch, "UNAVAILABLE")
        h.retry_at = 0  # the first probe is due: a request's round starts it, inside its context

        async def request_round():
            bind_contextvars(request_id="r1")
            ready["now"] = True
            return await h.usable()

        assert not await asyncio.create_task(request_round())  # (a probe now runs, from the request)
        await h.check_now()  # joins that probe instead of starting a second
        assert h.up and h.epoch == 1
        h.failed(h.epoch, "UNAVAILABLE")  # next outage: its probe is 60 s away
        await h.check_now()
        assert not h.up  # the backoff holds
        h.retry_at = 0
        await h.check_now()  # due: probes at once, no request needed
        assert h.up and h.epoch == 2

    saved, cap = structlog.get_config(), structlog.testing.LogCapture()
    structlog.configure(processors=[merge_contextvars, cap])
    try:
        clear_contextvars()
        asyncio.run(scenario())
    finally:
        structlog.configure(**saved)
    resumed = [e for e in cap.entries if e["event"].startswith("draft service ready again")]
    assert len(resumed) == 2 and "request_id" not in resumed[0], cap.entries
