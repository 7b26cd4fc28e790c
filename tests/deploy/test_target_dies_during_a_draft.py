"""The target killed while a request waits for its draft (not for the target) must still end
the request with UNAVAILABLE naming the target, never UNKNOWN. The round's next verify then
writes to a target stream that has already ended. Break test (session 4): the client got UNKNOWN
"Unexpected <class 'asyncio.exceptions.InvalidStateError'>: RPC already finished." and the
orchestrator logged a traceback. The drafter is frozen (SIGSTOP) for a moment so that the kill
lands inside a draft call every time (with a healthy drafter the same happens whenever the kill
falls inside one).
"""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from specdec_client.probe import check
from test_reliability import ORCH, PROMPT, Stream, wait_until


# slow: restarts the target (~20-40 s). Fixed in _Sessions.exchange: an asyncio.InvalidStateError
# from call.write becomes the call's own status, named.
@pytest.mark.slow
def test_target_killed_during_a_draft_call_is_unavailable(stack):
    s = stack
    st = Stream(s.address, **PROMPT, max_tokens=400, ignore_eos=True, mode="tree", tree_budget=8)
    try:
        assert st.first.wait(120) and st.error is None, st.error
        s.procs["draft"].send_signal(signal.SIGSTOP)  # the next round waits in its draft call (<= 2 s)
        time.sleep(0.3)
        s.procs["target"].kill()
        st.join(60)
    finally:
        s.procs["draft"].send_signal(signal.SIGCONT)
        if s.procs["target"].poll() is None:
            s.procs["target"].kill()
        s.procs["target"].wait()
        s.start("target")
        s.wait_healthy("target")
    assert st.result is None, "a truncated answer was returned as finished"
    assert st.error is not None and st.error.code == grpc.StatusCode.UNAVAILABLE, st.error
    assert "target service at" in st.error.details, st.error.details
    wait_until(lambda: check(s.address, ORCH) == "SERVING", 30, "readiness did not recover")
