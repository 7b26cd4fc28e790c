"""ServiceHost.run_engine(inline=True): a per-round engine call skips the thread hop only when
the engine thread is idle — never running beside queued or running engine work (a prefill)."""
import asyncio
import threading

from serving.server import ServiceHost


def test_inline_call_runs_on_the_loop_when_idle_and_queues_behind_busy_engine_work():
    async def scenario():
        host = ServiceHost([], 4)
        loop_thread = threading.get_ident()
        try:
            # idle engine thread: the call runs right here, on the event loop's thread
            assert await host.run_engine(threading.get_ident, inline=True) == loop_thread
            # engine work in flight (a long prefill): an inline call must wait for it, on the engine thread
            release, order = threading.Event(), []

            def prefill():
                release.wait(5)
                order.append("prefill")

            def verify():
                order.append("verify")
                return threading.get_ident()

            long = asyncio.ensure_future(host.run_engine(prefill))
            await asyncio.sleep(0)  # the prefill is submitted
            assert host.engine_busy == 1
            short = asyncio.ensure_future(host.run_engine(verify, inline=True))
            await asyncio.sleep(0.05)
            assert order == []  # not run beside the prefill
            release.set()
            ran_on = await short
            await long
            assert order == ["prefill", "verify"] and ran_on != loop_thread and host.engine_busy == 0
        finally:
            host.executor.shutdown(wait=True)
    asyncio.run(scenario())
