"""``kvserve serve --replicas N``: each replica's own arguments."""

from __future__ import annotations

import os

from kvserve.router.serving import disk_dir_of_replica


def test_each_replica_gets_a_disk_tier_directory_of_its_own() -> None:
    argv = ["--model", "m", "--kv-disk-dir", "/data/kv", "--kv-disk-gb", "4"]
    assert disk_dir_of_replica(argv, 1) == ["--model", "m", "--kv-disk-dir", os.path.join("/data/kv", "replica-1"),
                                             "--kv-disk-gb", "4"]
    assert disk_dir_of_replica(["--kv-disk-dir=/d"], 0) == ["--kv-disk-dir=" + os.path.join("/d", "replica-0")]
    assert disk_dir_of_replica(["--model", "m"], 3) == ["--model", "m"]  # no disk tier: unchanged
