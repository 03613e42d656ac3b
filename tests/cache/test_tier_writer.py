"""The tier writer's bound on queued payloads: a tier slower than the step loop drops writes, never memory."""

from __future__ import annotations

import threading

from kvserve.cache.tier_coordinator import TierWriter


def test_writes_past_the_queued_bytes_bound_are_dropped_and_the_rest_run_in_order() -> None:
    writer = TierWriter(max_queued_bytes=100)
    slow_tier = threading.Event()
    ran: list[int] = []

    def job(i: int):
        def write() -> None:
            if i == 0:
                slow_tier.wait(10)
            ran.append(i)
        return write

    assert writer.submit(job(0), 60)  # running, its bytes still held until it is done
    assert writer.submit(job(1), 40)
    assert not writer.submit(job(2), 1)  # 101 bytes would wait: dropped
    assert writer.submit(job(3))  # no payload (a sweep): never dropped
    slow_tier.set()
    assert writer.drain(10)
    assert ran == [0, 1, 3] and writer.num_dropped == 1
    assert writer.submit(job(4), 100)  # room again once written
    assert writer.drain(10) and ran[-1] == 4
    assert writer.submit(job(5), 1000)  # past the bound, but nothing waits: taken (never dropped for its size)
    assert writer.drain(10) and ran[-1] == 5 and writer.num_dropped == 1
    writer.stop(10)
