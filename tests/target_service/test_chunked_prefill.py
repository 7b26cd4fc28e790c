"""Chunked prefill under the step token budget (issue 14 §5, plans/0009): a long prompt that
arrives while greedy, seeded-sampled and autoregressive requests decode is carried in chunks by
their verify steps (decode rows first, chunks in what is left of ``step_tokens``) or by
prefill-only steps; every request's output equals its solo run, no step exceeds the budget, the
prompt advances in every step while it is queued, and a release mid-prefill frees its KV. Real
engine, real SmolLM2 weights (CPU, fp32), verifies through a real ``StepBatcher`` as the
servicer runs them."""
import random
import threading
import time

import pytest

from modeling.acceptance import resolve
from modeling.errors import UnknownRequest
from modeling.sampling import SamplingParams
from serving.batcher import StepBatcher
from target_service.engine import TargetEngine, VerifyItem

CHUNK, BUDGET = 8, 24  # prompt pieces of 8 rows; a step holds ≤ 24 rows (slow test)
# (id, prompt length, params, mode, tree budget); "long": 7 pieces, > 2 budgets (≥ 3 chunks at any load)
DECODERS = [("greedy-tree", 9, SamplingParams(), "tree", 4),
            ("seeded-chain", 6, SamplingParams(0.9, 40, 0.95, 7), "chain", 3),
            ("ar", 5, SamplingParams(1.1, 0, 1.0, 3), "autoregressive", 0)]
LONG = ("long", 7 * CHUNK - 3, SamplingParams(), "tree", 4)


def prompt_of(rid, n):
    r = random.Random(rid)
    return [r.randrange(1, 49000) for _ in range(n)]


def decode(engine, submit, spec, rounds=None, until=None, started=None):
    """Prefill, then verify rounds (random trees: what is accepted is decided by the target's own
    samples, so the output is the target's whatever the tree): ``rounds`` rounds, or until
    ``until`` is set and 1 more. Sets ``started`` after 2 rounds. Returns (tokens, samples per
    round)."""
    rid, plen, params, mode, budget = spec
    r = random.Random(rid + "-trees")
    bonus = engine.prefill(rid, prompt_of(rid, plen), 200, params, mode, budget).first_token
    out, seen, commit, last = [bonus], [], None, rounds
    while last is None or len(seen) < last:
        n = 1 if mode == "autoregressive" else 1 + budget
        tokens = [bonus] + r.sample(range(50, 40000), n - 1)
        parents = list(range(-1, n - 1)) if mode == "chain" else [-1] + [r.randrange(i) for i in range(1, n)]
        v = submit(VerifyItem(rid, tokens, parents, commit))
        commit, bonus = resolve(tokens, parents, v.samples)
        out += [tokens[i] for i in commit[1:]] + [bonus]
        seen.append(v.samples)
        if started is not None and len(seen) == 2:
            started.set()
        if last is None and until.is_set():
            last = len(seen) + 1
    engine.release([rid])
    return out, seen


@pytest.fixture(scope="module")
def make_engine(target_model):
    return lambda chunk=CHUNK, budget=BUDGET: TargetEngine(
        target_model, (1, 14, 27), max_context=512, kv_pool_tokens=4096, max_tree_budget=8,
        prefill_chunk=chunk, step_tokens=budget)


def mixed_run(make_engine, decoders, long, chunk=CHUNK, budget=BUDGET):
    """``decoders`` decode through a StepBatcher; after their 2nd round ``long`` opens and
    decodes 1 round; the decoders stop 1 round after it. Checks the step log, then each
    request against its solo run in a fresh engine (same rounds)."""
    engine = make_engine(chunk, budget)
    batcher = StepBatcher(engine.verify_batch, name="verify")
    started, long_done, got, errors = threading.Event(), threading.Event(), {}, []

    def run(spec, **kw):
        try:
            got[spec[0]] = decode(engine, batcher.submit, spec, **kw)
        except BaseException as e:  # surfaced below
            errors.append(e)
            started.set()
            long_done.set()

    threads = [threading.Thread(target=run, args=(s,), kwargs=dict(until=long_done, started=started))
               for s in decoders]
    for t in threads:
        t.start()
    started.wait(120)
    long_thread = threading.Thread(target=lambda: (run(long, rounds=1), long_done.set()))
    with engine._model_lock:  # the prompt arrives while a decoder's verify waits for the model:
        long_thread.start()  # that verify's step carries its first chunk
        while not (engine._queue and engine._verifies_waiting) and not errors:
            time.sleep(0.001)
    for t in threads + [long_thread]:
        t.join(300)
    assert not errors, errors
    log = list(engine.step_log)
    assert max(d + p for d, p, _ in log) <= budget
    assert all(p > 0 for _, p, q in log if q), "a queued prompt did not advance in some step"
    assert any(d > 0 and p > 0 for d, p, _ in log), "no step carried decode and prefill rows together"
    assert sum(p for _, p, _ in log) == long[1] + sum(s[1] for s in decoders)
    assert engine.live_requests == 0 and engine.reserved_tokens == 0
    for spec in decoders + [long]:
        solo = make_engine(chunk, budget)
        assert decode(solo, lambda it: solo.verify(it.request_id, it.tokens, it.parents, it.commit), spec,
                      rounds=len(got[spec[0]][1])) == got[spec[0]], spec[0]


def test_long_prompt_under_load_equals_solo_within_the_step_budget(make_engine):
    """A greedy prompt of 3 chunks (pieces of 16 rows, budget 17: one piece per step next to the
    decoder's row) arriving while a sampled autoregressive request decodes gives its solo
    output; so does the decoder; steps stay within the budget."""
    mixed_run(make_engine, DECODERS[2:], ("long3", 3 * 16 - 2, SamplingParams(), "tree", 4), 16, 17)


@pytest.mark.slow
def test_mixed_requests_and_a_long_prompt_equal_solo(make_engine):
    """Greedy tree, seeded chain and sampled autoregressive requests decode while a greedy prompt
    of ≥ 3 chunks is prefilled; each output equals its solo run."""
    mixed_run(make_engine, DECODERS, LONG)


def test_release_mid_prefill_frees_its_kv(make_engine):
    """A release while a long prompt is queued stops it before its next chunk (UnknownRequest
    naming how far it got) and frees its rows; the decoding request is unaffected."""
    engine = make_engine()
    spec = DECODERS[0]
    bonus = engine.prefill(spec[0], prompt_of(spec[0], spec[1]), 200, spec[2], spec[3], spec[4]).first_token
    held = engine.reserved_tokens
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(
        UnknownRequest, engine.prefill, "gone", prompt_of("gone", 400), 8, SamplingParams())))
    with engine._model_lock:  # the prompt queues; its first step waits for this verify's turn
        t.start()
        while not engine._queue:
            time.sleep(0.001)
    engine.verify(spec[0], [bonus], [-1])  # carries a chunk of "gone" (≤ budget − 1 decode row)
    assert 0 < engine.step_log[-1][1] < 400
    engine.release(["gone"])
    t.join(60)
    msg = str(errors[0].value)
    done = int(msg.split("after ")[1].split(" of")[0])
    assert 0 < done < 400 and engine.reserved_tokens == held and engine.live_requests == 1
    engine.release([spec[0]])
    assert engine.reserved_tokens == 0 and not engine._queue and not engine._prefilling
