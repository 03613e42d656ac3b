"""The KV tier options of the CLI: durations, and how they reach StorageConfig."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from kvserve.cache.tiers import GIB, TieredKVStore, disk_capacity_bytes
from kvserve.cli import build_parser, engine_config_from_args, parse_duration
from kvserve.config import DEFAULT_DISK_GB
from kvserve.errors import ConfigError
from kvserve.storage.base import KeyNamespace


@pytest.mark.parametrize(("text", "seconds"), [("72h", 259200.0), ("30m", 1800.0), ("5s", 5.0), ("3600", 3600.0),
                                               ("1.5h", 5400.0), ("2d", 172800.0), (" 10S ", 10.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "abc", "0", "-5s", "nan", "inf", "5x"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_tier_options_reach_the_storage_config() -> None:
    args = build_parser().parse_args(["serve", "--kv-host-gb", "4", "--kv-disk-gb", "20", "--kv-disk-dir", "/var/kv",
                                      "--kv-redis-url", "redis://127.0.0.1:6379/0", "--kv-retention", "30m",
                                      "--kv-write-policy", "write_through"])
    storage = engine_config_from_args(args).storage
    assert (storage.host_gb, storage.disk_gb, storage.disk_dir, storage.redis_url) == (
        4.0, 20.0, "/var/kv", "redis://127.0.0.1:6379/0")
    assert storage.retention_s == 1800.0 and storage.write_policy == "write_through" and storage.enabled
    default = engine_config_from_args(build_parser().parse_args(["generate"])).storage
    assert not default.enabled and default.retention_s == 72 * 3600


def test_disk_dir_alone_turns_the_disk_tier_on_at_its_default_size(tmp_path: Path) -> None:
    directory = str(tmp_path / "kv")
    storage = engine_config_from_args(build_parser().parse_args(["serve", "--kv-disk-dir", directory])).storage
    assert storage.enabled and storage.disk_gb is None
    tiers = TieredKVStore(storage, KeyNamespace("m", "float32", 16), (16, 2), payload_nbytes=128)
    assert tiers.names == ["disk"] and tiers.disk is not None
    free = shutil.disk_usage(directory).free
    assert tiers.disk.capacity_bytes == pytest.approx(min(DEFAULT_DISK_GB * GIB, free / 2), rel=0.01)
    assert disk_capacity_bytes(directory, 0.5) == GIB // 2  # a size given is taken as it is


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-disk-gb", "5"], "disk_gb needs disk_dir"),
    (["--kv-disk-gb", "0", "--kv-disk-dir", "/var/kv"], "disk_gb must be > 0 with disk_dir"),
    (["--kv-host-gb", "-1"], "host_gb must be a number >= 0"),
    (["--kv-disk-gb", "inf", "--kv-disk-dir", "/var/kv"], "disk_gb must be a number >= 0"),
])
def test_tier_sizes_that_cannot_work_are_refused_with_what_to_change(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_tiers_without_the_prefix_cache_or_too_small_for_a_block_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="extend the prefix cache"):
        engine_config_from_args(build_parser().parse_args(["serve", "--kv-host-gb", "1", "--no-enable-prefix-caching"]))
    storage = engine_config_from_args(build_parser().parse_args(["serve", "--kv-host-gb", "1e-7"])).storage
    with pytest.raises(ConfigError, match="host tier .* cannot hold one KV block"):
        TieredKVStore(storage, KeyNamespace("m", "float32", 16), (16, 2), payload_nbytes=1 << 20)
    storage = engine_config_from_args(build_parser().parse_args(
        ["serve", "--kv-disk-dir", str(tmp_path), "--kv-disk-gb", "1e-6"])).storage
    with pytest.raises(ConfigError, match="disk tier .* cannot hold one KV block"):
        TieredKVStore(storage, KeyNamespace("m", "float32", 16), (16, 2), payload_nbytes=1 << 20)
