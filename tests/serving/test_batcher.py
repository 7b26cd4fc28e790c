"""StepBatcher with a real batch function: items submitted from many threads while a batch runs
form the next batch (up to max_batch), each caller gets its own result or exception, a dead
caller's item never reaches run_batch, a failing batch fails only its own items and the next
batch runs as usual, close fails (or drains) what is queued; a lone caller runs its batch on its
own thread, and batches queued behind a leader are run by their own callers' threads."""
import threading
import time

import pytest

from serving.batcher import Closed, Skipped, StepBatcher


class Squares:
    """run_batch: x → x², a negative x → ValueError for that item alone, "boom" in the batch →
    the whole call raises. Records each call's items; the first call waits for ``gate``."""

    def __init__(self):
        self.calls: list[list] = []
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, items):
        self.calls.append(list(items))
        self.entered.set()
        self.gate.wait(10)
        if "boom" in items:
            raise RuntimeError("batch failed")
        return [ValueError(f"negative {x}") if x < 0 else x * x for x in items]


def submit_all(b: StepBatcher, items, alive=None):
    """Submit each item from its own thread (in order, each queued before the next starts);
    returns {item: result or exception} once all are done, and the threads."""
    out, threads = {}, []

    def one(x):
        try:
            out[x] = b.submit(x, alive(x) if alive else None)
        except Exception as e:
            out[x] = e
    for x in items:
        before = b.queued
        t = threading.Thread(target=one, args=(x,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 5
        while b.queued == before and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.001)
    return out, threads


def wait(threads):
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def first_call_running(b: StepBatcher, fn: Squares):
    """Start a first batch of one item (100) that blocks in ``fn`` until its gate opens."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(100, b.submit(100)))
    t.start()
    assert fn.entered.wait(5)
    return out, [t]


def test_items_queued_during_a_batch_form_the_next_batch_in_order():
    fn = Squares()
    b = StepBatcher(fn, max_batch=4)
    out0, t0 = first_call_running(b, fn)
    out, threads = submit_all(b, [1, 2, 3, 4, 5, 6, 7])
    assert b.queued == 7
    fn.gate.set()
    wait(t0 + threads)
    assert fn.calls == [[100], [1, 2, 3, 4], [5, 6, 7]]  # FIFO, at most max_batch per call
    assert out0 == {100: 10000} and out == {x: x * x for x in range(1, 8)}
    assert (b.batches, b.items) == (3, 8)
    b.close()


def test_an_item_error_reaches_its_caller_only():
    fn = Squares()
    b = StepBatcher(fn, max_batch=8)
    _, t0 = first_call_running(b, fn)
    out, threads = submit_all(b, [2, -3, 4])
    fn.gate.set()
    wait(t0 + threads)
    assert fn.calls[1] == [2, -3, 4]
    assert out[2] == 4 and out[4] == 16
    assert isinstance(out[-3], ValueError) and str(out[-3]) == "negative -3"
    b.close()


def test_a_failing_batch_fails_its_items_and_the_next_batch_runs():
    fn = Squares()
    b = StepBatcher(fn, max_batch=8)
    _, t0 = first_call_running(b, fn)
    out, threads = submit_all(b, [5, "boom"])
    fn.gate.set()
    wait(t0 + threads)
    assert all(isinstance(out[x], RuntimeError) and str(out[x]) == "batch failed" for x in (5, "boom"))
    assert b.submit(6) == 36  # the batcher serves the next batch
    b.close()


def test_wrong_number_of_results_fails_the_batch():
    gate = threading.Event()
    seen = []

    def short(items):
        seen.append(list(items))
        gate.wait(10)
        return [0] if len(items) > 1 else [x for x in items]

    b = StepBatcher(short, max_batch=8)
    t = threading.Thread(target=b.submit, args=(9,))
    t.start()
    while not seen:
        time.sleep(0.001)
    out, threads = submit_all(b, [1, 2])
    gate.set()
    wait([t] + threads)
    assert all(isinstance(out[x], RuntimeError) and "2 items" in str(out[x]) for x in (1, 2))
    assert b.submit(3) == 3
    b.close()


def test_an_item_whose_caller_is_gone_is_skipped():
    fn = Squares()
    b = StepBatcher(fn, max_batch=8)
    _, t0 = first_call_running(b, fn)
    gone = {7}
    out, threads = submit_all(b, [6, 7, 8], alive=lambda x: (lambda: x not in gone))
    fn.gate.set()
    wait(t0 + threads)
    assert fn.calls[1] == [6, 8]  # the engine never saw 7
    assert isinstance(out[7], Skipped) and out[6] == 36 and out[8] == 64
    fn.gate.clear()  # a batch of dead items only: no engine call at all
    fn.entered.clear()
    _, t1 = first_call_running(b, fn)
    only_dead, threads = submit_all(b, [9], alive=lambda x: (lambda: False))
    fn.gate.set()
    wait(t1 + threads)
    assert isinstance(only_dead[9], Skipped) and [9] not in fn.calls and len(fn.calls) == 3
    b.close()


def test_max_batch_one_runs_one_item_per_call():
    fn = Squares()
    b = StepBatcher(fn, max_batch=1)
    _, t0 = first_call_running(b, fn)
    out, threads = submit_all(b, [1, 2, 3])
    fn.gate.set()
    wait(t0 + threads)
    assert fn.calls == [[100], [1], [2], [3]]
    b.close()
    with pytest.raises(ValueError, match="max_batch"):
        StepBatcher(fn, max_batch=0)


def test_close_fails_queued_items_or_drains_them():
    fn = Squares()
    b = StepBatcher(fn, max_batch=8)
    out0, t0 = first_call_running(b, fn)
    out, threads = submit_all(b, [1, 2])
    closer = threading.Thread(target=b.close)  # waits for the running batch
    closer.start()
    wait(threads)
    assert all(isinstance(out[x], Closed) for x in (1, 2))
    with pytest.raises(Closed):
        b.submit(3)
    fn.gate.set()
    wait(t0 + [closer])
    assert out0 == {100: 10000} and fn.calls == [[100]]  # the running batch finished

    fn2 = Squares()
    d = StepBatcher(fn2, max_batch=8)
    _, t1 = first_call_running(d, fn2)
    out, threads = submit_all(d, [4, 5])
    closer = threading.Thread(target=d.close, kwargs={"drain": True})
    closer.start()
    fn2.gate.set()
    wait(t1 + threads + [closer])
    assert out == {4: 16, 5: 25} and fn2.calls == [[100], [4, 5]]


@pytest.mark.parametrize("package", ["target_service", "draft_service"])
def test_max_batch_flag(package, capsys, monkeypatch):
    """--max-batch (SPECDEC_MAX_BATCH) on both workers, default 64, refused below 1 as the other
    size flags (--batch-wait-us below 0 likewise); the host hands both to every batcher it made."""
    import importlib

    from serving.server import ServiceHost

    main = importlib.import_module(f"{package}.__main__")
    assert main.parse_args([]).max_batch == 64 and main.parse_args(["--max-batch", "1"]).max_batch == 1
    monkeypatch.setenv("SPECDEC_MAX_BATCH", "0")
    with pytest.raises(SystemExit) as e:
        main.parse_args([])
    assert e.value.code == 2 and "--max-batch must be >= 1 (got 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.parse_args(["--max-batch", "2", "--batch-wait-us", "-1"])
    assert "--batch-wait-us must be >= 0 (got -1)" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_MAX_BATCH", "5")
    assert main.parse_args([]).max_batch == 5
    host = ServiceHost([main.ROLE.service])
    b = host.batcher(lambda items: items, "test")
    assert b.max_batch == 5  # the variable's value also reaches hosts built without the flag (tests)
    host.set_batching(3, 0.001)
    assert (b.max_batch, b.wait_s) == (3, 0.001) and b.submit(7) == 7
    host.close()
    with pytest.raises(Closed):
        b.submit(8)


def test_a_gather_window_lets_a_late_item_join_until_the_batch_is_full():
    fn = Squares()
    fn.gate.set()
    b = StepBatcher(fn, max_batch=2, wait_s=30.0)  # full at 2: the window ends then, not after 30 s
    out, threads = {}, []
    for x in (3, 4):
        threads.append(threading.Thread(target=lambda x=x: out.setdefault(x, b.submit(x))))
        threads[-1].start()
        time.sleep(0.05)  # the second item comes 50 ms after the first, inside its window
    wait(threads)
    assert fn.calls == [[3, 4]] and out == {3: 9, 4: 16}
    b.close()


def test_who_runs_the_batches():
    fn, names = Squares(), []

    def record(items):
        names.append(threading.current_thread().name)
        return fn(items)

    b = StepBatcher(record, max_batch=1)
    fn.gate.set()
    assert b.submit(2) == 4 and names == [threading.current_thread().name]  # alone: no hand-off
    fn.gate.clear()
    fn.entered.clear()
    _, t0 = first_call_running(b, fn)  # its caller leads; 3 and 4 queue behind it, a batch each
    out, threads = submit_all(b, [3, 4])
    fn.gate.set()
    wait(t0 + threads)
    assert out == {3: 9, 4: 16} and names[1:] == [t.name for t in t0 + threads]  # each ran on its caller's thread
    b.close()


def test_the_gather_window_ends_once_every_live_request_sent():
    fn, live = Squares(), [1]
    fn.gate.set()
    b = StepBatcher(fn, max_batch=64, wait_s=30.0, expected=lambda: live[0])
    t = time.monotonic()
    assert b.submit(5) == 25 and time.monotonic() - t < 5  # one live request: no wait for others
    live[0] = 2
    out, threads = {}, []
    for x in (6, 7):
        threads.append(threading.Thread(target=lambda x=x: out.setdefault(x, b.submit(x))))
        threads[-1].start()
        time.sleep(0.05)
    wait(threads)
    assert fn.calls[-1] == [6, 7] and out == {6: 36, 7: 49}
    b.close()


def test_a_leader_that_raises_leaves_no_wedge():
    """A leader whose own gather window raises (here ``expected``; also a BaseException out of
    run_batch) takes its item out of the queue: the next caller leads again, nothing hangs."""
    calls = []

    def expected():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("expected() failed")
        return 1

    b = StepBatcher(lambda items: [x * x for x in items], max_batch=8, wait_s=0.5, expected=expected)
    with pytest.raises(RuntimeError, match="expected"):
        b.submit(2)
    out = []
    t = threading.Thread(target=lambda: out.append(b.submit(3)), daemon=True)
    t.start()
    t.join(5)
    assert out == [9] and b.queued == 0  # before: the lead went to the raising thread's own entry
    b.close(timeout=1)


def test_the_gather_window_ends_when_a_request_leaves():
    """2 live requests, one sends, the other leaves (its release calls ``leave``): the window
    (30 s) ends at once instead of waiting for a message that never comes."""
    fn, live = Squares(), [2]
    fn.gate.set()
    b = StepBatcher(fn, max_batch=64, wait_s=30.0, expected=lambda: live[0])
    out = []
    t = threading.Thread(target=lambda: out.append(b.submit(4)), daemon=True)
    t.start()
    time.sleep(0.1)
    assert out == []  # waiting for the second request
    live[0] = 1
    b.leave()
    t.join(5)
    assert out == [16]
    b.close(timeout=1)


def keyed_after_ab(wait_s: float, expected: int, first: str):
    """A keyed batcher (item = (request, x)) whose last batch ran requests a and b together,
    after a batch of ``first`` alone; returns (its Squares function, the batcher)."""
    fn = Squares()
    b = StepBatcher(lambda items: fn([x for _, x in items]), max_batch=8, wait_s=wait_s, expected=lambda: expected,
                    key=lambda item: item[0])
    lead = threading.Thread(target=b.submit, args=((first, 100),))
    lead.start()
    assert fn.entered.wait(5)
    _, ab = submit_all(b, [("a", 1), ("b", 1)])
    fn.gate.set()
    wait([lead] + ab)
    return fn, b


def test_the_gather_window_stops_waiting_for_a_request_that_went_quiet():
    """Keyed items: requests a and b run together, then b stays live but sends nothing (an
    adaptive request in one-token rounds keeps its draft session). a's next batch waits for b
    (b ran with it last time), the ones after it run at once."""
    fn, b = keyed_after_ab(wait_s=0.3, expected=2, first="a")
    assert fn.calls == [[100], [1, 1]]  # a and b together
    took = []
    for i in range(4):
        t0 = time.monotonic()
        assert b.submit(("a", i)) == i * i
        took.append(time.monotonic() - t0)
    assert took[0] >= 0.25  # b was in the previous batch: the window ran its course
    assert max(took[1:]) < 0.2  # then only a is due: no wait (before: 0.3 s each, b counted as live)
    b.close(timeout=1)


@pytest.mark.parametrize("package", ["target_service", "draft_service"])
def test_batching_flag_upper_bounds(package, capsys, monkeypatch):
    """--batch-wait-us above 1 s (a window that long is no batching trade; above ~9.2e15 µs it
    overflowed the wait) and --max-sessions at or above the RPC slots are usage errors."""
    import importlib

    main = importlib.import_module(f"{package}.__main__")
    assert main.parse_args(["--batch-wait-us", "1000000"]).batch_wait_us == 10 ** 6
    with pytest.raises(SystemExit) as e:
        main.parse_args(["--batch-wait-us", "10000000000000000"])
    assert e.value.code == 2 and "--batch-wait-us must be <= 1000000 (got 10000000000000000)" in capsys.readouterr().err
    assert main.parse_args([]).max_sessions == 512 - 16
    monkeypatch.setenv("SPECDEC_SESSION_THREADS", "64")
    with pytest.raises(SystemExit):
        main.parse_args(["--max-sessions", "64"])
    assert "--max-sessions must be <= 63 (got 64)" in capsys.readouterr().err
    assert main.parse_args([]).max_sessions == 48


def test_the_gather_window_waits_for_its_cohort_only():
    """Keyed items: a and b ran together, c in another batch (out of step: busy on the other
    worker). a's window waits for b — not for c — and c, whose cohort is itself, no longer waits
    (a request's first item waits for expected() once)."""
    fn, b = keyed_after_ab(wait_s=0.5, expected=3, first="x")
    t0 = time.monotonic()
    assert b.submit(("c", 2)) == 4 and time.monotonic() - t0 >= 0.4  # its first item waits for expected()
    out, threads = {}, []
    for k in "ab":  # b 50 ms after a: inside a's window, which then ends (cohort complete)
        threads.append(threading.Thread(target=lambda k=k: out.setdefault(k, b.submit((k, 3)))))
        threads[-1].start()
        time.sleep(0.05)
    t0 = time.monotonic()
    wait(threads)
    assert out == {"a": 9, "b": 9} and fn.calls[-1] == [3, 3] and time.monotonic() - t0 < 0.4  # not waiting for c
    t0 = time.monotonic()
    assert b.submit(("c", 4)) == 16 and time.monotonic() - t0 < 0.4  # c's cohort is c alone
    b.close(timeout=1)


def test_a_lone_item_runs_at_once_and_a_failure_there_leaves_no_wedge():
    """The fast path (batcher idle, nothing queued, no gather window): the item runs as a batch of
    one on its caller's thread and counts as a cohort of its own; an item queued while it runs
    gets the lead after it, also when the lone batch raised a BaseException; close() then returns."""
    class Stop(BaseException):
        pass

    calls, gate, entered = [], threading.Event(), threading.Event()

    def run(items):
        calls.append((list(items), threading.current_thread().name))
        if items == [1]:
            entered.set()
            gate.wait(10)
            raise Stop()
        return [x * x for x in items]

    b = StepBatcher(run, max_batch=8, key=lambda x: x)
    assert b.submit(3) == 9 and calls == [([3], threading.current_thread().name)] and b.queued == 0
    assert (b.batches, b.items, b._batch_of) == (1, 1, {3: 1})
    out = {}

    def lone():
        try:
            b.submit(1)
        except Stop:
            out[1] = "stopped"
    t1 = threading.Thread(target=lone, name="lone")
    t1.start()
    assert entered.wait(5)
    t2 = threading.Thread(target=lambda: out.setdefault(2, b.submit(2)), name="queued")
    t2.start()
    deadline = time.monotonic() + 5
    while b.queued == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert b.queued == 1  # behind the lone batch, not run beside it
    gate.set()
    wait([t1, t2])
    assert out == {1: "stopped", 2: 4} and calls[1:] == [([1], "lone"), ([2], "queued")]
    assert b.queued == 0 and b.submit(5) == 25
    t = time.monotonic()
    b.close(timeout=5)
    assert time.monotonic() - t < 1


def test_a_raising_key_reaches_its_caller_and_leaves_the_batcher_idle():
    """The fast path notes the lone item's cohort before it takes the lead: a key that raises
    (a bad request id) fails that submit only; the next submit runs and close() returns (breaker,
    session 8: the lead was taken first and never handed on, so every later submit hung)."""
    def key(x):
        if x < 0:
            raise KeyError(x)
        return x

    b = StepBatcher(lambda items: [x + 1 for x in items], max_batch=4, key=key)
    with pytest.raises(KeyError):
        b.submit(-1)
    assert not b._leading and b._batch_of == {}
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", b.submit(1)))
    t.start()
    t.join(5)
    assert box == {"r": 2}
    b.close(timeout=5)


def _submit_group(b: StepBatcher, items, alive=None):
    """``submit_many(items)`` on its own thread, once queued; returns (result holder, thread)."""
    out, before = {}, b.queued
    t = threading.Thread(target=lambda: out.setdefault("r", b.submit_many(items, alive)))
    t.start()
    deadline = time.monotonic() + 5
    while b.queued == before and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.001)
    return out, t


def test_a_group_runs_in_one_batch_with_what_else_is_queued():
    """``submit_many`` (a Steps message's items): its items run in one call, with single items
    queued around it, even when together they pass max_batch; per item its result or its
    exception, in order, never raised; a group after a full batch waits for the next one."""
    fn = Squares()
    b = StepBatcher(fn, max_batch=4)
    _, t0 = first_call_running(b, fn)
    singles, threads = submit_all(b, [1])
    group, tg = _submit_group(b, [2, -3, 4, 5])
    later, tl = submit_all(b, [6])
    fn.gate.set()
    wait(t0 + threads + [tg] + tl)
    assert fn.calls == [[100], [1], [2, -3, 4, 5], [6]]  # the group did not fit with 1 (max 4): its own call
    r = group["r"]
    assert r[0] == 4 and isinstance(r[1], ValueError) and r[2:] == [16, 25]
    assert singles == {1: 1} and later == {6: 36} and (b.batches, b.items) == (4, 7)
    assert b.submit_many([]) == [] and b.submit_many([3]) == [9]

    fn.calls.clear()
    fn.gate.clear()
    fn.entered.clear()
    _, t1 = first_call_running(b, fn)
    big, tb = _submit_group(b, [1, 2, 3, 4, 5, 6])  # alone over max_batch: one call all the same
    fn.gate.set()
    wait(t1 + [tb])
    assert fn.calls == [[100], [1, 2, 3, 4, 5, 6]] and big["r"] == [1, 4, 9, 16, 25, 36]
    b.close()


def test_a_group_whose_stream_is_gone_or_whose_batch_fails_gets_an_error_per_item():
    fn = Squares()
    b = StepBatcher(fn, max_batch=8)
    _, t0 = first_call_running(b, fn)
    dead, td = _submit_group(b, [7, 8], alive=lambda: False)
    failing, tf = _submit_group(b, [9, "boom"])
    fn.gate.set()
    wait(t0 + [td, tf])
    assert [type(e) for e in dead["r"]] == [Skipped, Skipped] and [7, 8] not in fn.calls
    assert all(isinstance(e, RuntimeError) for e in failing["r"]) and len(failing["r"]) == 2
    b.close()
    assert [type(e) for e in b.submit_many([1, 2])] == [Closed, Closed]
