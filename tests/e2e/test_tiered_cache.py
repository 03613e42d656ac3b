"""KV tiers below device memory on the real default model: host DRAM, disk, Redis, restarts and faults.

The device pool is 16 blocks of 16 tokens, far smaller than the prompts of one test together, so a
prefix is pushed out of device memory by two filler prompts (one step) and must come back from a tier.
Every output is compared with the same prompt computed from scratch by an engine without tiers; every
tier hit is asserted on ``cached_tokens_by_tier`` and on the engine's per-tier counters.

Weights are dequantised once per module (``fast_weights``): each test builds real ``LLM`` engines, but
without paying the GGUF dequantisation again.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import redis as redis_client
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine import Engine
from kvserve.errors import EngineDeadError
from kvserve.model.loader import iter_weights, read_arch_config, resolve_model_path
from kvserve.request import Request, RequestOutput
from kvserve.storage.base import EntryMeta, encode_entry, make_key
from kvserve.storage.disk import DiskKVStore
from tests.conftest import RedisServer, free_port
from tests.e2e.conftest import LONG_DOCUMENT

pytestmark = pytest.mark.slow

BLOCK = 16
POOL_BLOCKS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # the prefill's token and a decode's
FILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2-135M, float32: layers * (K, V) * tokens * kv heads * dim
GIB = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def fast_weights():
    path = resolve_model_path(None)
    weights = list(iter_weights(path, read_arch_config(path), torch.float32, show_progress=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvserve.engine.iter_weights", lambda *args, **kwargs: iter(weights))
        yield


def make_llm(**kwargs) -> LLM:
    return LLM(dtype="float32", num_kv_blocks=POOL_BLOCKS, max_num_batched_tokens=512, **kwargs)


@pytest.fixture(scope="module")
def no_cache_llm(fast_weights) -> LLM:
    return LLM(dtype="float32", num_kv_blocks=POOL_BLOCKS, max_num_batched_tokens=512, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(no_cache_llm: LLM) -> dict[str, list[int]]:
    """P and P2: a 64-token prefix (4 blocks) plus a question; F1, F2: fillers of 8 blocks each."""
    tok = no_cache_llm.get_tokenizer()
    ids = tok.encode(LONG_DOCUMENT, add_special_tokens=False)
    question = tok.encode(" In one word, the text is about", add_special_tokens=False)
    return {"P": ids[:64] + question, "P2": ids[64:128] + question, "F1": ids[200:320], "F2": ids[320:440]}


@pytest.fixture(scope="module")
def reference(no_cache_llm: LLM, prompts) -> dict[str, list[int]]:
    """Greedy outputs computed from scratch: no prefix cache, no tiers."""
    return {name: gen(no_cache_llm, prompts[name]).outputs[0].token_ids for name in ("P", "P2")}


def gen(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> RequestOutput:
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    llm.engine.check_invariants()
    return out


def evict_with_fillers(llm: LLM, prompts: dict[str, list[int]]) -> None:
    """Two 8-block prompts in one step: nothing else fits in the 16-block pool."""
    before = llm.engine.stats().num_evicted_blocks
    llm.generate([{"prompt_token_ids": prompts["F1"]}, {"prompt_token_ids": prompts["F2"]}], FILL)
    llm.engine.check_invariants()
    assert llm.engine.stats().num_evicted_blocks - before >= 4


def by_tier(out: RequestOutput) -> dict[str, int]:
    return {tier: n for tier, n in out.metrics.cached_tokens_by_tier.items() if n}


def block_paths(llm: LLM, prompt: list[int]) -> list[Path]:
    """Disk-tier files of the full blocks of ``prompt``, in order."""
    engine: Engine = llm.engine
    request = Request("probe", prompt, GREEDY, max_total_tokens=len(prompt) + 1, hash_extra=engine.block_hash_extra)
    tiers = engine.tiers
    assert tiers is not None and tiers.disk is not None
    return [tiers.disk.path_for(make_key(h, tiers.namespace)) for h in request.full_block_hashes(BLOCK)]


# ---------------------------------------------------------------------------------------------------------
def test_host_tier_computed_device_and_host_hits_give_identical_outputs(prompts, reference) -> None:
    llm = make_llm(kv_host_gb=0.25)
    computed = gen(llm, prompts["P"])
    device = gen(llm, prompts["P"])
    evict_with_fillers(llm, prompts)
    host = gen(llm, prompts["P"])
    assert by_tier(computed) == {}
    # Four full blocks and the first computation's partly filled fifth: all but the last token (a tail
    # stays in device memory; the tiers below keep full blocks only).
    assert by_tier(device) == {"device": len(prompts["P"]) - 1}
    assert by_tier(host) == {"host": 64} and host.num_cached_tokens == 64
    for out in (computed, device, host):
        assert out.outputs[0].token_ids == reference["P"]
    stats = llm.engine.stats()
    assert stats.tiers["host"].hits == 64 and stats.tiers["host"].bytes_read >= 4 * BLOCK_BYTES
    assert stats.cached_tokens_by_tier["host"] == 64 and stats.prefix_cache_hits >= 128
    llm.close()


def test_small_host_tier_spills_to_disk_and_a_restart_finds_the_prefix(prompts, reference, tmp_path) -> None:
    disk_dir = str(tmp_path / "kv")
    llm = make_llm(kv_host_gb=1.5 * BLOCK_BYTES / GIB, kv_disk_gb=0.25, kv_disk_dir=disk_dir)
    gen(llm, prompts["P"])
    evict_with_fillers(llm, prompts)
    out = gen(llm, prompts["P"])
    tiers = by_tier(out)
    assert tiers.get("disk", 0) >= 48 and tiers.get("disk", 0) + tiers.get("host", 0) == 64, tiers
    assert out.outputs[0].token_ids == reference["P"]
    assert llm.engine.stats().tiers["disk"].hits == tiers["disk"]
    llm.close()

    restarted = make_llm(kv_disk_gb=0.25, kv_disk_dir=disk_dir)  # a new engine: index rebuilt from the files
    out = gen(restarted, prompts["P"])
    assert by_tier(out)["disk"] >= 48 and out.num_cached_tokens == by_tier(out)["disk"]
    assert out.outputs[0].token_ids == reference["P"]
    restarted.close()


def test_after_a_step_that_raised_nothing_of_the_device_is_persisted(prompts, reference, tmp_path,
                                                                       monkeypatch) -> None:
    disk_dir = str(tmp_path / "kv")
    llm = make_llm(kv_disk_gb=0.25, kv_disk_dir=disk_dir)  # write_back: the device's cache is persisted at close

    def device_failure(out):
        raise RuntimeError("the device failed mid-step")

    monkeypatch.setattr(llm.engine.runner, "execute", device_failure)
    with pytest.raises(RuntimeError, match="mid-step"):
        gen(llm, prompts["P"])  # its blocks were cached as they were scheduled, and never computed
    with pytest.raises(EngineDeadError, match="did not finish"):  # never a step on state that no longer agrees
        gen(llm, prompts["P2"])
    llm.close()
    restarted = make_llm(kv_disk_gb=0.25, kv_disk_dir=disk_dir)
    out = gen(restarted, prompts["P"])
    assert by_tier(out) == {} and out.outputs[0].token_ids == reference["P"]
    restarted.close()


def test_corrupt_and_foreign_disk_entries_are_misses_and_outputs_stay_right(prompts, reference, tmp_path) -> None:
    disk_dir = str(tmp_path / "kv")
    llm = make_llm(kv_disk_gb=0.25, kv_disk_dir=disk_dir, kv_write_policy="write_through")
    assert gen(llm, prompts["P"]).outputs[0].token_ids == reference["P"]
    paths = block_paths(llm, prompts["P"])
    meta = llm.engine.tiers.meta
    llm.close()
    assert all(p.exists() for p in paths[:4])
    # Block 1: a valid entry of another model, under this model's key (a misconfigured shared directory).
    payload = os.urandom(BLOCK_BYTES)
    foreign = EntryMeta("another-model@0", meta.kv_dtype, meta.block_size, meta.shape)
    paths[1].write_bytes(encode_entry(payload, foreign))
    # Block 2: truncated half-way. Block 3: overwritten with garbage of the same length.
    blob = paths[2].read_bytes()
    paths[2].write_bytes(blob[: len(blob) // 2])
    paths[3].write_bytes(os.urandom(len(paths[3].read_bytes())))

    again = make_llm(kv_disk_gb=0.25, kv_disk_dir=disk_dir)
    out = gen(again, prompts["P"])
    assert by_tier(out) == {"disk": 16}  # block 0 loads; the run stops at the first bad entry
    assert out.outputs[0].token_ids == reference["P"]
    stats = again.engine.stats().tiers["disk"]
    assert stats.corrupt == 3 and not paths[1].exists() and not paths[2].exists() and not paths[3].exists()
    again.close()


def test_redis_tier_is_shared_between_engines_and_survives_redis_dying(prompts, reference, redis_server) -> None:
    first = make_llm(kv_redis_url=redis_server.url)  # no host, no disk: evictions go straight to Redis
    gen(first, prompts["P"])
    evict_with_fillers(first, prompts)
    out = gen(first, prompts["P"])
    assert by_tier(out) == {"redis": 64} and out.outputs[0].token_ids == reference["P"]
    assert first.engine.stats().tiers["redis"].hits == 64
    first.close()

    second = make_llm(kv_redis_url=redis_server.url)
    out = gen(second, prompts["P"])
    assert by_tier(out) == {"redis": 64} and out.outputs[0].token_ids == reference["P"]

    redis_server.kill()  # mid-run: the tier must degrade to misses, never fail a request
    t0 = time.monotonic()
    out = gen(second, prompts["P2"])
    evict_with_fillers(second, prompts)  # offloads to a dead Redis
    again = gen(second, prompts["P2"])
    assert by_tier(again).get("redis", 0) == 0
    assert out.outputs[0].token_ids == again.outputs[0].token_ids == reference["P2"]
    stats = second.engine.stats()
    assert stats.tiers["redis"].errors >= 1 and stats.tiers_healthy == {"redis": False}
    assert time.monotonic() - t0 < 120
    second.close()


def test_full_disk_and_a_redis_that_never_started_degrade_to_recompute(prompts, reference, tmp_path,
                                                                       monkeypatch) -> None:
    def disk_full(self, tmp, blob):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskKVStore, "_write_file", disk_full)
    llm = make_llm(kv_host_gb=1.5 * BLOCK_BYTES / GIB, kv_disk_gb=0.25, kv_disk_dir=str(tmp_path / "kv"),
                   kv_redis_url=f"redis://127.0.0.1:{free_port()}/0")
    outs = [gen(llm, prompts["P"])]
    evict_with_fillers(llm, prompts)
    outs.append(gen(llm, prompts["P"]))
    assert all(out.outputs[0].token_ids == reference["P"] for out in outs)
    assert by_tier(outs[1]).get("disk", 0) == 0 and by_tier(outs[1]).get("redis", 0) == 0
    stats = llm.engine.stats()
    assert stats.tiers["disk"].errors >= 1 and stats.tiers["redis"].errors >= 1
    assert stats.tiers_healthy == {"host": True, "disk": False, "redis": False}
    llm.close()


def test_retention_expires_entries_in_every_tier(prompts, reference, tmp_path, redis_server: RedisServer) -> None:
    disk_dir = tmp_path / "kv"
    llm = make_llm(kv_host_gb=0.25, kv_disk_gb=0.25, kv_disk_dir=str(disk_dir), kv_redis_url=redis_server.url,
                   kv_retention_s=2.0, kv_write_policy="write_through")
    client = redis_client.Redis(host="127.0.0.1", port=redis_server.port)
    assert gen(llm, prompts["P"]).outputs[0].token_ids == reference["P"]
    stats = llm.engine.stats().tiers
    assert stats["host"].entries == 4 and stats["disk"].entries == 4 and len(client.keys("kvserve:*")) == 4
    time.sleep(2.2)
    gen(llm, prompts["P"][:10], FILL)  # a step with no full block to store: the engine's periodic sweep runs
    stats = llm.engine.stats().tiers
    assert stats["host"].entries == 0 and stats["disk"].entries == 0
    assert stats["host"].expirations == 4 and stats["disk"].expirations == 4
    assert not list(disk_dir.rglob("*.kv")) and client.keys("kvserve:*") == []
    llm.engine.kv_manager.prefix_cache.tree.evict(POOL_BLOCKS)
    out = gen(llm, prompts["P"])
    assert by_tier(out) == {} and out.outputs[0].token_ids == reference["P"]
    client.close()
    llm.close()


def test_write_back_kv_is_persisted_at_close_and_found_after_a_restart(prompts, reference, tmp_path) -> None:
    """Default write_back: the prefix never left device memory, yet close() writes it to disk."""
    disk_dir = str(tmp_path / "kv")
    llm = make_llm(kv_host_gb=0.25, kv_disk_gb=0.25, kv_disk_dir=disk_dir)
    gen(llm, prompts["P"])
    assert llm.engine.tiers is not None and llm.engine.tiers.disk is not None
    assert llm.engine.tiers.disk.num_entries == 0  # nothing was evicted: the KV is only on the device
    llm.close()

    restarted = make_llm(kv_disk_gb=0.25, kv_disk_dir=disk_dir)
    out = gen(restarted, prompts["P"])
    assert by_tier(out) == {"disk": 64}
    assert out.outputs[0].token_ids == reference["P"]
    restarted.close()
