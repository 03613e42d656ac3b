"""The tier coordinator keeps disk and Redis I/O off the step loop: a Redis that stops answering costs only
the lookups and writes queued for it, never a decode step."""

from __future__ import annotations

import os
import signal
import threading

import redis as redis_client

from kvserve.cache.kv_manager import KVCacheManager
from kvserve.cache.tier_coordinator import TierWriter
from kvserve.cache.tiers import TieredKVStore
from kvserve.config import SchedulerConfig, StorageConfig
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from kvserve.storage.base import KeyNamespace
from tests.conftest import RedisServer
from tests.support.fake_runner import FakeRunner, payload_nbytes, reference_continuation

BS = 4
NAMESPACE = KeyNamespace("fake-model@1", "int32", BS)


def make_request(rid: str, prompt: list[int], max_tokens: int, order: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_total_tokens=len(prompt) + max_tokens, arrival_order=order)


def step(scheduler: Scheduler, runner: FakeRunner) -> None:
    out = scheduler.schedule()
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    scheduler.check_invariants()


def redis_backed(redis_server: RedisServer) -> tuple[TieredKVStore, KVCacheManager, Scheduler, FakeRunner]:
    """A write-through Redis tier under a 64-block pool, its scheduler and a fake runner. A socket timeout far
    beyond the tests: a call that waits for a stopped server would hang."""
    store = TieredKVStore(StorageConfig(redis_url=redis_server.url, write_policy="write_through"), NAMESPACE,
                          (BS, 2), payload_nbytes=payload_nbytes(BS), redis_socket_timeout=600.0)
    kv = KVCacheManager(64, BS, True, store)
    return store, kv, Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv), FakeRunner(64, BS)


def test_a_redis_that_stops_answering_does_not_stall_decoding(redis_server: RedisServer) -> None:
    # A socket timeout far beyond the test: a call that waits for the stopped server would hang the step.
    store, kv, scheduler, runner = redis_backed(redis_server)
    decoding = make_request("decoding", list(range(10)), max_tokens=40, order=0)
    scheduler.add_request(decoding)
    while decoding.num_output_tokens < 2:  # admitted (its lookup answered) and decoding
        step(scheduler, runner)
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        waiting = make_request("waiting", list(range(20, 32)), max_tokens=4, order=1)
        scheduler.add_request(waiting)
        while not decoding.is_finished:
            step(scheduler, runner)
        # Every decode step ran while the write-through copies (a full block every 4 tokens) and the new
        # request's lookup were stuck on the stopped server.
        assert decoding.output_token_ids == reference_continuation(list(range(10)), 40)
        assert kv.tiers.num_pending_writes > 0  # type: ignore[attr-defined]
        assert waiting.status is RequestStatus.WAITING and waiting.num_computed_tokens == 0
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    while not waiting.is_finished:
        step(scheduler, runner)
    assert waiting.output_token_ids == reference_continuation(list(range(20, 32)), 4)
    assert kv.wait_for_tier_writes(timeout_s=60)
    client = redis_client.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        # Every full block of computed KV of both requests (all tokens but the last sampled one) reached
        # Redis once it answered again.
        assert len(client.keys("kvserve:*")) == (10 + 40 - 1) // BS + (12 + 4 - 1) // BS
    finally:
        client.close()
    kv.close(lambda block_ids: [runner.read_block(b) for b in block_ids])


def test_an_aborted_requests_tier_read_not_yet_started_is_dropped(redis_server: RedisServer) -> None:
    store, kv, scheduler, runner = redis_backed(redis_server)
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        requests = [make_request(f"w{i}", list(range(100 * i, 100 * i + 12)), 4, i) for i in range(3)]
        for request in requests:
            scheduler.add_request(request)
        step(scheduler, runner)  # each lookup is queued on the one fetch thread; the first is stuck on Redis
        fetches = dict(kv.tiers._fetches)  # type: ignore[attr-defined]
        assert set(fetches) == {r.request_id for r in requests}
        for request in requests[1:]:  # their clients left
            scheduler.abort_request(request.request_id)
        assert all(fetches[r.request_id].future.cancelled() for r in requests[1:])
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    while not requests[0].is_finished:
        step(scheduler, runner)
    kv.close(lambda block_ids: [runner.read_block(b) for b in block_ids])


def test_tier_writer_runs_jobs_in_order_and_drain_waits_for_them() -> None:
    release = threading.Event()
    done: list[int] = []
    writer = TierWriter()
    try:
        writer.submit(release.wait)
        for i in range(3):
            writer.submit(lambda i=i: done.append(i))
        assert not writer.drain(timeout_s=0.05)  # the first job holds the rest back
        assert writer.num_pending == 4 and done == []
        release.set()
        assert writer.drain(timeout_s=30)
        assert done == [0, 1, 2] and writer.num_pending == 0
    finally:
        release.set()
        writer.stop(timeout_s=5)


def test_a_failing_write_job_is_logged_and_the_writer_goes_on(caplog) -> None:
    writer = TierWriter()
    done: list[str] = []
    try:
        writer.submit(lambda: 1 / 0)
        writer.submit(lambda: done.append("next"))
        assert writer.drain(timeout_s=30)
        assert done == ["next"] and "tier write failed" in caplog.text
    finally:
        writer.stop(timeout_s=5)


def test_a_shutdown_reads_the_device_a_chunk_at_a_time() -> None:
    from kvserve.cache.kv_manager import read_in_chunks

    blocks = [(i, bytes([i]), b"id%d" % i) for i in range(150)]
    reads: list[list[int]] = []

    def read_blocks(block_ids: list[int]) -> list[bytes]:
        reads.append(block_ids)
        return [b"kv%d" % i for i in block_ids]

    persisted = read_in_chunks(blocks, read_blocks, chunk=64)
    first = next(persisted)
    assert first == (bytes([0]), b"id0", b"kv0") and reads == [list(range(64))]  # lazily, as written
    assert list(persisted)[-1] == (bytes([149]), b"id149", b"kv149")
    assert [len(r) for r in reads] == [64, 64, 22]


def test_lookups_past_the_bound_on_held_reads_are_misses(redis_server: RedisServer, monkeypatch) -> None:
    from kvserve.cache import tier_coordinator

    store, kv, scheduler, runner = redis_backed(redis_server)
    one_run = 2 * (store.identity_nbytes + payload_nbytes(BS))  # a 12-token prompt's two full blocks
    monkeypatch.setattr(tier_coordinator, "MAX_HELD_FETCH_BYTES", one_run)
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        first, second = (make_request(f"w{i}", list(range(100 * i, 100 * i + 12)), 4, i) for i in range(2))
        scheduler.add_request(first)
        scheduler.add_request(second)
        step(scheduler, runner)
        # The first one's read waits on Redis and holds the bound; the second one computes its prefix.
        assert first.status is RequestStatus.WAITING and second.num_computed_tokens > 0
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    while not (first.is_finished and second.is_finished):
        step(scheduler, runner)
    assert second.output_token_ids == reference_continuation(list(range(100, 112)), 4)
    kv.close(lambda block_ids: [runner.read_block(b) for b in block_ids])


def test_a_run_past_the_room_left_for_held_reads_is_read_as_far_as_it_fits(redis_server: RedisServer,
                                                                           monkeypatch) -> None:
    from kvserve.cache import tier_coordinator

    store, kv, scheduler, runner = redis_backed(redis_server)
    block = store.identity_nbytes + payload_nbytes(BS)
    monkeypatch.setattr(tier_coordinator, "MAX_HELD_FETCH_BYTES", 3 * block)
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for i in range(2):  # 12-token prompts: runs of two full blocks each
            scheduler.add_request(make_request(f"w{i}", list(range(100 * i, 100 * i + 12)), 4, i))
        step(scheduler, runner)
        fetches = dict(kv.tiers._fetches)  # type: ignore[attr-defined]
        runs = {rid: (f.stop - f.start, f.asked_stop - f.start) for rid, f in fetches.items()}
        assert runs == {"w0": (2, 2), "w1": (1, 2)}  # the second run read as far as the room left goes
        step(scheduler, runner)  # asked again for the same run: the same fetch, not another
        assert kv.tiers._fetches["w1"] is fetches["w1"]  # type: ignore[attr-defined]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    kv.close(lambda block_ids: [runner.read_block(b) for b in block_ids])
