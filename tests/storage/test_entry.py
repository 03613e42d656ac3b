"""Entry framing, keys, stats and backoff: the pieces every tier shares."""

from __future__ import annotations

import dataclasses
import logging
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.block_hash import hash_block
from kvserve.errors import StorageError
from kvserve.storage.base import (
    ENTRY_FORMAT_VERSION,
    Backoff,
    CorruptEntry,
    EntryMeta,
    KeyNamespace,
    TierStats,
    decode_entry,
    decode_entry_with_header,
    encode_entry,
    make_key,
    read_header,
)

META = EntryMeta(model_fingerprint="m@1", kv_dtype="float16", block_size=16, shape=(4, 2, 16, 8))


# --- framing ---------------------------------------------------------------------------------------------
def test_round_trip_and_header_fields() -> None:
    payload = bytes(range(256)) * 3
    blob = encode_entry(payload, META, created_at=1234.5)
    assert decode_entry(blob, META) == payload
    header, body = decode_entry_with_header(blob, META)
    assert body == payload
    assert header.meta == META
    assert header.created_at == 1234.5
    assert header.payload_len == len(payload)
    assert header.header_len + len(payload) == len(blob)


def test_empty_payload_round_trips() -> None:
    assert decode_entry(encode_entry(b"", META), META) == b""


@settings(max_examples=60, deadline=None)
@given(
    payload=st.binary(max_size=512),
    fingerprint=st.text(max_size=40),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "fp8_e4m3"]),
    block_size=st.sampled_from([1, 16, 256]),
    shape=st.lists(st.integers(0, 2**40), max_size=6).map(tuple),
    created_at=st.floats(0, 2e9),
)
def test_round_trip_any_meta(payload, fingerprint, dtype, block_size, shape, created_at) -> None:
    meta = EntryMeta(fingerprint, dtype, block_size, shape)
    blob = encode_entry(payload, meta, created_at=created_at)
    header, body = decode_entry_with_header(blob, meta)
    assert body == payload
    assert header.meta == meta
    assert header.created_at == created_at


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_fingerprint": "other@2"}, "fingerprint mismatch"),
        ({"kv_dtype": "bfloat16"}, "dtype mismatch"),
        ({"block_size": 32}, "block size mismatch"),
        ({"shape": (4, 2, 16, 4)}, "shape mismatch"),
        ({"layout_version": 1}, "layout version mismatch"),
    ],
)
def test_metadata_mismatch_is_corrupt(change: dict, reason: str) -> None:
    blob = encode_entry(b"payload", META)
    with pytest.raises(CorruptEntry) as info:
        decode_entry(blob, dataclasses.replace(META, **change))
    assert info.value.reason == reason
    assert isinstance(info.value, StorageError)


def test_bad_magic_and_version() -> None:
    blob = bytearray(encode_entry(b"payload", META))
    bad_magic = b"XXXX" + bytes(blob[4:])
    with pytest.raises(CorruptEntry, match="bad magic"):
        decode_entry(bad_magic, META)
    struct.pack_into("<H", blob, 4, ENTRY_FORMAT_VERSION + 1)
    with pytest.raises(CorruptEntry, match="format version"):
        decode_entry(bytes(blob), META)


def test_every_truncation_is_corrupt() -> None:
    blob = encode_entry(b"0123456789" * 10, META)
    for cut in range(len(blob)):
        with pytest.raises(CorruptEntry) as info:
            decode_entry(blob[:cut], META)
        assert info.value.reason in ("truncated", "bad header length")


def test_trailing_bytes_are_corrupt() -> None:
    with pytest.raises(CorruptEntry, match="trailing bytes"):
        decode_entry(encode_entry(b"abc", META) + b"\0", META)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_single_bit_flip_is_detected(data) -> None:
    blob = bytearray(encode_entry(b"some kv payload bytes" * 4, META, created_at=99.0))
    bit = data.draw(st.integers(0, len(blob) * 8 - 1))
    blob[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptEntry):
        decode_entry(bytes(blob), META)


@settings(max_examples=100, deadline=None)
@given(garbage=st.binary(max_size=300))
def test_garbage_never_decodes_and_never_raises_anything_else(garbage: bytes) -> None:
    with pytest.raises(CorruptEntry):
        decode_entry(garbage, META)


def test_garbage_with_valid_magic_is_corrupt() -> None:
    with pytest.raises(CorruptEntry):
        read_header(b"KVSE" + b"\xff" * 60)


# --- keys ------------------------------------------------------------------------------------------------
NS = KeyNamespace(model_fingerprint="m@1", kv_dtype="float16", block_size=16)


def test_make_key_layout_and_determinism() -> None:
    block_hash = hash_block(None, [1, 2, 3, 4])
    key = make_key(block_hash, NS)
    assert len(key) == 24
    assert key[8:] == block_hash
    assert key == make_key(block_hash, KeyNamespace("m@1", "float16", 16))
    assert make_key(hash_block(None, [1, 2, 3, 5]), NS) != key


@pytest.mark.parametrize(
    "change", [{"model_fingerprint": "m@2"}, {"kv_dtype": "bfloat16"}, {"block_size": 32}, {"layout_version": 1},
               {"numerics": "gguf-int8"}]
)
def test_every_namespace_field_changes_the_key(change: dict) -> None:
    block_hash = hash_block(None, [7] * 16)
    assert make_key(block_hash, dataclasses.replace(NS, **change)) != make_key(block_hash, NS)


def test_make_key_rejects_wrong_hash_length() -> None:
    with pytest.raises(ValueError):
        make_key(b"short", NS)


def test_entry_meta_for_namespace() -> None:
    meta = EntryMeta.for_namespace(NS, [4, 2, 16, 8])
    assert meta == META


def test_an_entry_written_with_other_numerics_is_refused_on_its_header() -> None:
    """Keys already differ by the namespace digest; the header says it too, so a read under another namespace
    (a digest collision, a file moved by hand) is refused rather than served."""
    int8 = dataclasses.replace(NS, numerics="gguf-int8")
    blob = encode_entry(b"\x01" * 8, EntryMeta.for_namespace(int8, [4, 2, 16, 8]))
    decode_entry_with_header(blob, EntryMeta.for_namespace(int8, [4, 2, 16, 8]))
    for other in (NS, dataclasses.replace(NS, numerics="gguf")):
        with pytest.raises(CorruptEntry, match="fingerprint mismatch"):
            decode_entry_with_header(blob, EntryMeta.for_namespace(other, [4, 2, 16, 8]))


# --- stats -----------------------------------------------------------------------------------------------
def test_tier_stats_copy_is_independent() -> None:
    stats = TierStats(hits=3, misses=1)
    snapshot = stats.copy()
    stats.hits += 1
    assert snapshot.hits == 3
    assert snapshot.hit_rate == 0.75
    assert TierStats().hit_rate == 0.0
    assert set(snapshot.as_dict()) >= {"hits", "misses", "bytes_read", "bytes_written", "entries", "bytes_held",
                                       "evictions", "expirations", "errors", "corrupt", "load_latency_s",
                                       "load_count"}


# --- backoff ---------------------------------------------------------------------------------------------
def test_backoff_schedule_probe_and_cap(backoff_clock) -> None:
    b = Backoff("t", initial_s=1.0, max_s=4.0, clock=backoff_clock)
    assert b.healthy and b.allow()
    b.record_failure(OSError("down"))
    assert not b.healthy
    assert not b.allow()
    backoff_clock.advance(0.99)
    assert not b.allow()
    backoff_clock.advance(0.02)
    assert b.allow()  # one probe ...
    assert not b.allow()  # ... and only one while it is in flight
    b.record_failure(OSError("still down"))
    backoff_clock.advance(1.5)
    assert not b.allow()  # second delay is 2 s
    backoff_clock.advance(0.6)
    assert b.allow()
    for _ in range(5):
        b.record_failure(OSError("down"))
    assert b.retry_after - backoff_clock() == pytest.approx(4.0)  # capped
    assert b.num_failures == 7 and b.total_failures == 7
    backoff_clock.advance(4.0)
    assert b.allow()
    b.record_success()
    assert b.healthy and b.num_failures == 0 and b.allow()


def test_backoff_warns_once_per_outage(backoff_clock, caplog: pytest.LogCaptureFixture) -> None:
    b = Backoff("tier-x", initial_s=1.0, clock=backoff_clock)
    with caplog.at_level(logging.INFO, logger="kvserve.storage.base"):
        for _ in range(10):
            b.record_failure(OSError("boom"))
        b.record_success()
        b.record_failure(OSError("boom again"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per outage, not one per failure
    assert "tier-x" in warnings[0].getMessage() and "boom" in warnings[0].getMessage()
    assert any("recovered" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_backoff_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        Backoff("t", initial_s=0)
    with pytest.raises(ValueError):
        Backoff("t", initial_s=2, max_s=1)
