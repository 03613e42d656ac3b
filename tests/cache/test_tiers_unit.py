"""The tiered KV store and its use by the KV manager, with the fake runner (no model, no torch).

The fake runner's KV payload of a block is the bytes of its (position, token) slots, so a block loaded
from the wrong entry, into the wrong block, or after being overwritten changes the sampled tokens:
comparing with ``reference_continuation`` checks the whole offload / load path.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvserve.storage.redis as redis_store
from kvserve.batch import SchedulerOutput
from kvserve.block_hash import block_identity, hash_block
from kvserve.cache.kv_manager import KVCacheManager
from kvserve.cache.tiers import GIB, TieredKVStore
from kvserve.config import SchedulerConfig, StorageConfig
from kvserve.errors import ConfigError
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from kvserve.storage.base import Backoff, KeyNamespace, make_key
from kvserve.storage.redis import RedisKVStore
from tests.conftest import SocketSpy, free_port
from tests.storage.conftest import FakeClock
from tests.support.fake_runner import FakeRunner, payload_nbytes, reference_continuation

BS = 4
NBYTES = payload_nbytes(BS)
NAMESPACE = KeyNamespace("fake-model@1", "int32", BS)
SHAPE = (BS, 2)
IDENTITY_NBYTES = len(block_identity(None, [0] * BS))


def gb(num_blocks: float) -> float:
    """host_gb / disk_gb holding about ``num_blocks`` fake blocks (disk entries carry a ~90-byte header)."""
    return num_blocks * (IDENTITY_NBYTES + NBYTES) / GIB


def make_tiers(clock=None, **storage) -> TieredKVStore:
    kwargs = {"clock": clock} if clock is not None else {}
    return TieredKVStore(StorageConfig(**storage), NAMESPACE, SHAPE, payload_nbytes=NBYTES, **kwargs)


def h(i: int) -> bytes:
    return hash_block(None, [i] * BS)


def identity(i: int) -> bytes:
    return block_identity(None, [i] * BS)


def payload(i: int) -> bytes:
    return bytes([i % 256]) * NBYTES


def block(i: int) -> tuple[bytes, bytes, bytes]:
    return h(i), identity(i), payload(i)


def run(*ids: int) -> tuple[list[bytes], list[bytes]]:
    """``lookup_run``'s arguments for blocks ``ids``."""
    return [h(i) for i in ids], [identity(i) for i in ids]


# ---------------------------------------------------------------------------------------------------------
# TieredKVStore on its own
# ---------------------------------------------------------------------------------------------------------
def test_write_back_spills_host_evictions_to_disk_and_lookup_walks_the_tiers(tmp_path: Path) -> None:
    tiers = make_tiers(host_gb=gb(2), disk_gb=gb(20), disk_dir=str(tmp_path))
    tiers.put_blocks([block(i) for i in range(4)])  # host keeps 2, 0 and 1 go down to disk
    assert tiers.host is not None and tiers.disk is not None
    assert tiers.host.num_entries == 2 and tiers.disk.num_entries == 2
    found = tiers.lookup_run(*run(0, 1, 2, 3, 9, 3))
    assert [p for _, p in found] == [payload(i) for i in range(4)]
    assert [t for t, _ in found] == ["disk", "disk", "host", "host"]
    # The disk hits were promoted into the host tier, which spilled 2 and 3 down to disk to make room.
    assert tiers.lookup_run(*run(0, 1)) == [("host", payload(0)), ("host", payload(1))]
    assert tiers.lookup_run(*run(0, 1, 2, 3))[2:] == [("disk", payload(2)), ("disk", payload(3))]
    assert tiers.lookup_run(*run(7, 0)) == []  # a run starts at the first hash or not at all


def test_write_through_puts_everywhere_and_lower_tiers_serve_after_host_loss(tmp_path: Path) -> None:
    tiers = make_tiers(host_gb=gb(10), disk_gb=gb(20), disk_dir=str(tmp_path), write_policy="write_through")
    tiers.put_blocks([block(i) for i in range(3)])
    assert tiers.host is not None and tiers.disk is not None
    assert tiers.host.num_entries == 3 and tiers.disk.num_entries == 3
    tiers.host.clear()
    assert [t for t, _ in tiers.lookup_run(*run(0, 1, 2))] == ["disk"] * 3


def test_no_host_tier_writes_straight_down(tmp_path: Path) -> None:
    tiers = make_tiers(disk_gb=gb(20), disk_dir=str(tmp_path))
    tiers.put_blocks([block(1)])
    assert tiers.lookup_run(*run(1)) == [("disk", payload(1))]
    assert tiers.holds(h(1)) and not tiers.holds(h(2))


def test_wrong_length_payload_ends_the_run_and_counts_an_error() -> None:
    tiers = make_tiers(host_gb=gb(10))
    assert tiers.host is not None
    tiers.put_blocks([block(0), block(1), block(2)])
    tiers.host.put(make_key(h(1), NAMESPACE), b"short")
    assert tiers.lookup_run(*run(0, 1, 2)) == [("host", payload(0))]
    assert tiers.stats()["host"].errors == 1
    assert not tiers.host.contains(make_key(h(1), NAMESPACE))  # deleted, not warned about at every lookup


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_an_entry_holding_another_block_under_the_key_looked_up_is_refused(tmp_path: Path, tier: str,
                                                                           request: pytest.FixtureRequest) -> None:
    """A forged hash collision, or a foreign writer on a shared Redis: block 2's entry (its identity and KV)
    stored under block 1's key."""
    sizes = {"host": {"host_gb": gb(10)}, "disk": {"disk_gb": gb(20), "disk_dir": str(tmp_path)}}.get(tier)
    tiers = make_tiers(**(sizes or {"redis_url": request.getfixturevalue("redis_server").url}))
    tiers.put_blocks([block(0), block(1), block(2)])
    forged = identity(2) + payload(2)
    store = {"host": tiers.host, "disk": tiers.disk, "redis": tiers.redis}[tier]
    assert store is not None and store.put(make_key(h(1), NAMESPACE), forged)
    assert tiers.lookup_run(*run(0, 1, 2)) == [(tier, payload(0))]
    stats = tiers.stats()[tier]
    assert stats.refused == 1 and stats.errors == 0
    assert not store.contains(make_key(h(1), NAMESPACE))  # deleted: the next writer of block 1 may store it
    assert tiers.lookup_run(*run(2)) == [(tier, payload(2))]  # the genuine block 2 still loads


def test_other_namespace_never_matches(tmp_path: Path) -> None:
    mine = make_tiers(disk_gb=gb(20), disk_dir=str(tmp_path))
    other = TieredKVStore(StorageConfig(disk_gb=gb(20), disk_dir=str(tmp_path / "o")),
                          KeyNamespace("other-model", "int32", BS), SHAPE, payload_nbytes=NBYTES)
    other.put_blocks([block(1)])
    assert mine.lookup_run(*run(1)) == []


def test_retention_sweeps_host_and_disk(tmp_path: Path) -> None:
    clock = FakeClock()
    tiers = make_tiers(clock, host_gb=gb(1), disk_gb=gb(20), disk_dir=str(tmp_path), retention_s=10.0)
    tiers.put_blocks([block(i) for i in range(3)])
    clock.advance(11)
    assert tiers.sweep() == 3
    stats = tiers.stats()
    assert stats["host"].entries == 0 and stats["disk"].entries == 0
    assert stats["host"].expirations + stats["disk"].expirations == 3
    assert tiers.lookup_run(*run(0)) == []


def redis_backoff_on(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> list[RedisKVStore]:
    """The tiers build their Redis store themselves: give it a backoff on ``clock``, so that a probe goes
    through only when the test moves the clock. Returns the stores built (the test checks it took)."""
    built: list[RedisKVStore] = []

    def make(*args: Any, **kwargs: Any) -> RedisKVStore:
        kwargs.setdefault("backoff", Backoff("redis", initial_s=1.0, clock=clock))
        built.append(RedisKVStore(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(redis_store, "RedisKVStore", make)
    return built


def test_dead_redis_is_a_bounded_miss_and_other_tiers_still_serve(monkeypatch) -> None:
    port = free_port()
    built = redis_backoff_on(monkeypatch, FakeClock(start=0.0))
    spy = SocketSpy.install(monkeypatch, port)
    tiers = make_tiers(host_gb=gb(10), redis_url=f"redis://127.0.0.1:{port}/0")
    assert tiers.redis is not None and built == [tiers.redis]
    assert not tiers.redis.healthy  # the constructor's PING failed
    assert spy.connects() == [0.5]  # once, bounded by the socket timeout
    tiers.put_blocks([block(0)])
    assert tiers.lookup_run(*run(0, 1)) == [("host", payload(0))]
    assert spy.num_calls == 1  # Redis is skipped until the backoff lets a probe through
    assert tiers.stats()["redis"].errors >= 1


def test_a_hung_redis_blocks_one_call_for_at_most_the_socket_timeout_then_is_skipped(redis_server,
                                                                                    monkeypatch) -> None:
    built = redis_backoff_on(monkeypatch, FakeClock(start=0.0))
    spy = SocketSpy.install(monkeypatch, redis_server.port)
    tiers = make_tiers(host_gb=gb(1), redis_url=redis_server.url)
    assert built == [tiers.redis]
    tiers.put_blocks([block(i) for i in range(3)])  # host keeps one, the rest go to Redis
    assert [t for t, _ in tiers.lookup_run(*run(0, 1))] == ["redis", "redis"]
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # alive but silent: every read would wait forever
    try:
        before = spy.num_calls
        assert tiers.lookup_run(*run(0, 1)) == []
        # One read waited out the 0.5 s socket timeout (no retry), then the backoff skips Redis entirely.
        assert spy.num_timed_out(before) == 1 and spy.bounded_by(0.5, before)
        after_first = spy.num_calls
        for _ in range(20):
            tiers.lookup_run(*run(0, 1))
            tiers.put_blocks([block(9)])
        assert spy.num_calls == after_first
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert tiers.healthy()["redis"] is False and tiers.stats()["redis"].errors >= 1


def test_record_admission_counts_tokens_per_tier() -> None:
    tiers = make_tiers(host_gb=gb(10))
    tiers.record_admission(100, {"device": 40, "host": 20})
    stats = tiers.stats()["host"]
    assert (stats.hits, stats.misses) == (20, 40)


def test_storage_config_validation() -> None:
    with pytest.raises(ConfigError):
        StorageConfig(disk_gb=1.0)
    with pytest.raises(ConfigError):
        StorageConfig(disk_dir="/tmp/x", disk_gb=0)
    assert StorageConfig(disk_dir="/tmp/x").enabled  # at the default capacity
    for retention in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError):
            StorageConfig(retention_s=retention)
    with pytest.raises(ConfigError):
        StorageConfig(write_policy="sometimes")  # type: ignore[arg-type]
    assert not StorageConfig().enabled and StorageConfig(redis_url="redis://x").enabled


# ---------------------------------------------------------------------------------------------------------
# The manager, scheduler and fake runner: offload on eviction, load on lookup
# ---------------------------------------------------------------------------------------------------------
class Harness:
    """Scheduler + fake runner + tiers, stepped as Engine.step does it."""

    def __init__(self, num_blocks: int, tiers: TieredKVStore | None, budget: int = 64, max_seqs: int = 8) -> None:
        self.kv = KVCacheManager(num_blocks, BS, True, tiers)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), self.kv)
        self.runner = FakeRunner(num_blocks, BS)
        self.next_id = 0

    def add(self, prompt: list[int], max_tokens: int = 3) -> Request:
        request = Request(f"r{self.next_id}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          max_total_tokens=len(prompt) + max_tokens, arrival_order=self.next_id)
        self.next_id += 1
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        self.scheduler.finish_requests(self.scheduler.update(out, result))
        self.scheduler.check_invariants()
        return out

    def run(self, max_steps: int = 5_000) -> None:
        steps = 0
        # Until nothing is left to run and nothing to copy out for the tiers, as Engine.has_unfinished_requests
        while self.scheduler.has_unfinished() or self.kv.has_pending_transfers:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        self.kv.wait_for_tier_writes()


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 7 + i * 3) % 50 for i in range(length)]


def test_evicted_prefix_is_written_to_host_and_loaded_back_instead_of_recomputed() -> None:
    tiers = make_tiers(host_gb=gb(64))
    hx = Harness(num_blocks=10, tiers=tiers)
    shared = prompt_of(1, 24)  # 6 full blocks
    first = hx.add(shared + [1])
    hx.run()
    # Another prompt fills the pool, evicting the shared prefix from device memory.
    hx.add(prompt_of(2, 38))
    hx.run()
    assert hx.runner.num_blocks_offloaded >= 6 and tiers.host is not None and tiers.host.num_entries >= 6
    before = hx.runner.num_computed_tokens
    second = hx.add(shared + [2, 3])
    out = hx.step()
    assert len(out.kv_loads) == 6  # nothing of the prefix was left on the device
    assert second.num_cached_tokens == 24
    assert second.metrics.cached_tokens_by_tier == {"device": 0, "host": 24}
    hx.run()
    assert hx.runner.num_computed_tokens - before == 2 + 2  # the suffix, then two decode steps
    assert first.output_token_ids == reference_continuation(shared + [1], 3)
    assert second.output_token_ids == reference_continuation(shared + [2, 3], 3)
    assert hx.kv.stats.hits_by_tier == {"device": 0, "host": 24}
    assert tiers.stats()["host"].hits == 24


def test_disk_reads_run_off_the_loop_while_other_requests_decode(tmp_path: Path, monkeypatch) -> None:
    import threading

    tiers = make_tiers(disk_gb=gb(64), disk_dir=str(tmp_path))  # no host tier: evictions go to disk
    hx = Harness(num_blocks=12, tiers=tiers)
    shared = prompt_of(1, 24)
    hx.add(shared + [1])
    hx.run()
    hx.add(prompt_of(2, 44))  # fills the pool: the shared prefix goes to disk
    hx.run()
    assert tiers.disk is not None and tiers.disk.num_entries >= 6
    gate = threading.Event()
    read_disk = tiers.disk.get_many
    monkeypatch.setattr(tiers.disk, "get_many", lambda keys: gate.wait(5) and read_disk(keys))

    busy = hx.add(prompt_of(3, 3), max_tokens=10)
    hx.step()
    second = hx.add(shared + [2, 3])
    for _ in range(4):  # the disk read is stuck: the other request keeps decoding meanwhile
        out = hx.step()
        assert [s.request_id for s in out.scheduled] == [busy.request_id]
    assert second.num_computed_tokens == 0 and not second.block_ids
    gate.set()
    hx.run()
    assert second.metrics.cached_tokens_by_tier == {"device": 0, "disk": 24}
    assert second.output_token_ids == reference_continuation(shared + [2, 3], 3)
    assert busy.output_token_ids == reference_continuation(prompt_of(3, 3), 10)


def test_device_hit_continues_into_the_host_tier() -> None:
    tiers = make_tiers(host_gb=gb(64))
    hx = Harness(num_blocks=12, tiers=tiers)
    shared = prompt_of(3, 32)
    hx.add(shared + [1])
    hx.run()
    # The partly filled block after the prefix (the request's 33rd token and output) goes first, then the
    # last three blocks of the prefix (LRU tail first).
    assert hx.kv.prefix_cache.tree.num_tail_blocks == 1
    hx.kv.prefix_cache.tree.evict(4)
    hx.run()  # nothing runs: the queued offloads are flushed as Engine does when idle
    second = hx.add(shared + [5])
    hx.run()
    assert second.metrics.cached_tokens_by_tier == {"device": 20, "host": 12}
    assert second.output_token_ids == reference_continuation(shared + [5], 3)


def test_a_wrong_payload_changes_the_output() -> None:
    """The harness can fail: corrupting what the host tier holds (right length, wrong KV) is visible."""
    tiers = make_tiers(host_gb=gb(64))
    hx = Harness(num_blocks=10, tiers=tiers)
    shared = prompt_of(4, 24)
    hx.add(shared + [1])
    hx.run()
    hx.add(prompt_of(5, 38))
    hx.run()
    assert tiers.host is not None
    request = hx.add(shared + [2])
    key = make_key(request.full_block_hashes(BS)[3], NAMESPACE)
    stored = tiers.host.get(key)
    assert stored is not None
    tiers.host.put(key, stored[:-4] + (49).to_bytes(4, "little"))  # one token of block 3 changed
    hx.run()
    assert request.metrics.cached_tokens_by_tier["host"] == 24
    assert request.output_token_ids != reference_continuation(shared + [2], 3)


def test_a_block_of_another_prompt_stored_under_the_key_is_refused_and_the_output_stays_right() -> None:
    """The same corruption as above, but as a colliding writer would leave it: another prompt's block (its
    identity and its KV, both consistent) under this prompt's key. The hit stops before it."""
    tiers = make_tiers(host_gb=gb(64))
    hx = Harness(num_blocks=10, tiers=tiers)
    shared, other = prompt_of(4, 24), prompt_of(7, 24)
    hx.add(shared + [1])
    donor_request = hx.add(other + [1])
    hx.run()
    hx.add(prompt_of(5, 38))
    hx.run()
    assert tiers.host is not None
    request = hx.add(shared + [2])
    victim = make_key(request.full_block_hashes(BS)[3], NAMESPACE)
    donor = make_key(donor_request.full_block_hashes(BS)[3], NAMESPACE)
    forged = tiers.host.get(donor)
    assert forged is not None and tiers.host.get(victim) is not None
    tiers.host.put(victim, forged)
    hx.run()
    assert request.metrics.cached_tokens_by_tier["host"] == 12  # blocks 0..2; block 3 refused, recomputed
    assert request.output_token_ids == reference_continuation(shared + [2], 3)
    assert tiers.stats()["host"].refused == 1
    assert tiers.host.get(victim) != forged  # deleted at once (or since replaced by the recomputed block)


def test_write_through_offloads_blocks_as_they_fill_and_a_fresh_pool_finds_them(tmp_path: Path) -> None:
    tiers = make_tiers(host_gb=gb(64), disk_gb=gb(200), disk_dir=str(tmp_path), write_policy="write_through")
    hx = Harness(num_blocks=32, tiers=tiers)
    shared = prompt_of(6, 20)
    hx.add(shared + [1], max_tokens=6)
    hx.run()
    assert hx.kv.num_evicted_blocks == 0
    assert tiers.disk is not None and tiers.disk.num_entries == 6  # 26 tokens computed: 6 full blocks
    # A "restarted" engine: new device pool, and new tiers on the same directory (host DRAM is gone).
    restarted = make_tiers(host_gb=gb(64), disk_gb=gb(200), disk_dir=str(tmp_path), write_policy="write_through")
    hx2 = Harness(num_blocks=32, tiers=restarted)
    again = hx2.add(shared + [2])
    hx2.run()
    assert again.metrics.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 20}
    assert again.output_token_ids == reference_continuation(shared + [2], 3)
    assert hx2.runner.num_blocks_offloaded == 0  # loaded blocks are not written back where they came from


def test_allocation_failure_with_a_tier_hit_releases_everything_and_loads_nothing() -> None:
    tiers = make_tiers(host_gb=gb(64))
    hx = Harness(num_blocks=10, tiers=tiers, budget=64)
    shared = prompt_of(7, 24)
    hx.add(shared + [1])
    hx.run()
    hx.add(prompt_of(8, 38))
    hx.run()  # the shared prefix now lives in the host tier only
    hog = hx.add(prompt_of(9, 30), max_tokens=10)  # 8 blocks after its prefill, 10 at the end
    while hog.num_computed_tokens < 30:
        hx.step()
    waiting = hx.add(shared + [2])
    assert tiers.host is not None
    reads = tiers.host.stats().load_count
    out = hx.step()
    assert waiting.status.value == "waiting" and not out.kv_loads
    assert not hx.kv.tiers.pending_load_block_ids() and waiting.block_ids == []
    hx.step()
    assert waiting.status.value == "waiting"
    assert tiers.host.stats().load_count == reads + 1  # looked up at every step, read from the tier once
    hx.run()
    assert waiting.metrics.cached_tokens_by_tier["host"] == 24
    assert waiting.output_token_ids == reference_continuation(shared + [2], 3)
    assert hog.output_token_ids == reference_continuation(prompt_of(9, 30), 10)


def test_offloads_are_copied_out_before_loads_reuse_their_blocks() -> None:
    """One step evicts B's blocks (offload) and reallocates them for A's load: B must be copied out first,
    or the host tier stores A's KV under B's hashes and B's next load is wrong."""
    tiers = make_tiers(host_gb=gb(64))
    hx = Harness(num_blocks=10, tiers=tiers)
    shared_a, shared_b = prompt_of(11, 24), prompt_of(12, 24)
    hx.add(shared_a + [1])
    hx.run()
    hx.add(prompt_of(13, 38))
    hx.run()  # A is in the host tier only
    hx.add(shared_b + [1])
    hx.run()  # B is cached on the device, never offloaded
    a2 = hx.add(shared_a + [2])
    out = hx.step()
    reused = {block_id for block_id, _ in out.kv_offloads} & {block_id for block_id, _ in out.kv_loads}
    assert reused, "the scenario needs a block offloaded and loaded in one step"
    hx.run()
    hx.add(prompt_of(14, 38))
    hx.run()  # B leaves the device: the next B request loads what was copied out above
    b2 = hx.add(shared_b + [2])
    hx.run()
    assert b2.metrics.cached_tokens_by_tier["host"] == 24
    assert a2.output_token_ids == reference_continuation(shared_a + [2], 3)
    assert b2.output_token_ids == reference_continuation(shared_b + [2], 3)


def test_concurrent_requests_share_loaded_blocks() -> None:
    tiers = make_tiers(host_gb=gb(64))
    hx = Harness(num_blocks=24, tiers=tiers, budget=128)
    shared = prompt_of(10, 24)
    hx.add(shared + [1])
    hx.run()
    hx.kv.prefix_cache.tree.evict(100)
    hx.run()
    a, b = hx.add(shared + [2]), hx.add(shared + [3])
    out = hx.step()
    assert len(out.kv_loads) == 6  # b found the blocks a's load put in the tree
    assert a.metrics.cached_tokens_by_tier["host"] == 24 and b.metrics.cached_tokens_by_tier["device"] == 24
    assert a.block_ids[:6] == b.block_ids[:6]
    hx.run()
    assert b.output_token_ids == reference_continuation(shared + [3], 3)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 40), st.integers(1, 6)),
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 40), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 20), st.just(0), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
    ),
    min_size=4,
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(ops=ops, num_blocks=st.integers(10, 16), host_blocks=st.integers(0, 30),
       write_through=st.booleans())
def test_random_workloads_with_tiers_keep_invariants_and_outputs(ops, num_blocks, host_blocks, write_through,
                                                                  tmp_path_factory) -> None:
    disk_dir = tmp_path_factory.mktemp("disk")
    tiers = make_tiers(host_gb=gb(host_blocks), disk_gb=gb(40), disk_dir=str(disk_dir),
                       write_policy="write_through" if write_through else "write_back")
    hx = Harness(num_blocks=num_blocks, tiers=tiers, budget=16)
    requests: list[Request] = []
    aborted: set[str] = set()
    for op, a, b, c in ops:
        if op == "add":
            # Prompts from a few shared stems, so prefixes recur after being evicted.
            requests.append(hx.add(prompt_of(a, 24)[: 8 + b % 17] + prompt_of(b, b % 5), max_tokens=c))
        elif op == "abort" and a < len(requests):
            if hx.scheduler.abort_request(requests[a].request_id) is not None:
                aborted.add(requests[a].request_id)
        else:
            for _ in range(a):
                hx.step()
    hx.run()
    pool = hx.kv.pool
    assert pool.num_used == 0 and pool.num_free + pool.num_evictable == num_blocks
    for request in requests:
        if request.request_id not in aborted:
            expected = reference_continuation(request.prompt_token_ids, request.sampling_params.max_tokens)
            assert request.output_token_ids == expected


def test_a_request_that_cannot_fit_leaves_the_cache_as_it_was() -> None:
    """A block no request references, in a node another request locks, counts as evictable in the pool but
    cannot be evicted: a request short by that much must wait without emptying the cache first."""
    hx = Harness(num_blocks=16, tiers=None)
    first, other = prompt_of(1, 8), prompt_of(2, 8)
    hx.add(first, max_tokens=1)
    hx.add(other, max_tokens=1)
    hx.run()
    hx.add(first, max_tokens=40)  # recomputes the last prompt block, its copy locking the first one's node
    for _ in range(3):
        hx.step()
    kv = hx.kv
    assert kv.pool.num_evictable > kv.prefix_cache.num_evictable_blocks()
    cached = kv.prefix_cache.num_cached_blocks
    too_big = hx.add(prompt_of(3, 4 * (kv.pool.num_free + kv.pool.num_evictable)), max_tokens=1)
    hx.step()
    assert too_big.num_computed_tokens == 0 and kv.prefix_cache.num_cached_blocks == cached
