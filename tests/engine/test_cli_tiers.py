"""The KV tier options of the CLI: durations, and how they reach StorageConfig."""

from __future__ import annotations

import argparse

import pytest

from kvserve.cli import build_parser, engine_config_from_args, parse_duration
from kvserve.errors import ConfigError


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


def test_disk_dir_without_a_size_is_an_error() -> None:
    with pytest.raises(ConfigError):
        engine_config_from_args(build_parser().parse_args(["serve", "--kv-disk-dir", "/var/kv"]))
