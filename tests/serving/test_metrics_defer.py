"""``serving.metrics.defer`` / ``flush``: a worker's per-round observations are made after its
reply is sent, on the same thread, with the values measured when the work ran; nothing is lost
or made twice, and another thread's pending observations are its own."""
import threading

from prometheus_client import CollectorRegistry, Histogram

from serving import metrics


def test_deferred_observations_are_made_at_flush_on_their_own_thread():
    h = Histogram("t_defer_seconds", "test", ["op"], buckets=(0.001, 0.01, 1.0), registry=CollectorRegistry())
    verify = h.labels("verify")
    metrics.flush()  # (anything an earlier test left on this thread)
    metrics.defer(verify.observe, 0.0005)
    metrics.defer(verify.observe, 0.5)

    def count():
        return {s.labels.get("le"): s.value for s in h.collect()[0].samples if s.name == "t_defer_seconds_bucket"}
    assert count()["+Inf"] == 0  # not yet
    other = threading.Thread(target=metrics.flush)  # another thread's flush makes none of these
    other.start()
    other.join()
    assert count()["+Inf"] == 0
    metrics.flush()
    assert count() == {"0.001": 1, "0.01": 1, "1.0": 2, "+Inf": 2}
    metrics.flush()  # made once
    assert count()["+Inf"] == 2
    assert [s.value for s in h.collect()[0].samples if s.name == "t_defer_seconds_sum"] == [0.5005]
