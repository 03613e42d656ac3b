"""A real ``kvserve serve`` with a disk tier, SIGKILLed while it writes prompt blocks to disk (at a random point
of a streamed answer; the disk tier alone is killed twenty times over in tests/storage/test_disk_crash.py):
every entry file under a real name stays whole, and the next start rebuilds its index, loads what survived
and answers exactly as an engine without tiers does."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import openai
import pytest

from kvserve.storage.base import read_header
from tests.e2e.conftest import LONG_DOCUMENT
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-num-batched-tokens", "512",
               "--served-model-name", "smol", "--kv-write-policy", "write_through", "--kv-disk-gb", "1"]
# One prompt per life of the server: each life but the last is killed while writing the next one.
PROMPTS = [LONG_DOCUMENT[start : start + 600] + "\nIn one word, the text above is about"
           for start in range(0, 3000, 600)]
MAX_TOKENS = 6


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def answer(server: ServerProcess, prompt: str) -> tuple[str, int]:
    """Greedy text and the prompt tokens served from the disk tier."""
    response = client_for(server).completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, extra_body={"return_timings": True})
    tiers = response.model_extra["timings"]["cache_lookup"]["cached_tokens_by_tier"]
    return response.choices[0].text, tiers.get("disk", 0)


def kill_while_writing(server: ServerProcess, prompt: str, rng: random.Random) -> None:
    """Stream a new prompt (its blocks go to disk as its prefill fills them) and SIGKILL the server at a
    random moment after the first chunk."""
    stream = client_for(server).completions.create(model="smol", prompt=prompt, max_tokens=64, temperature=0,
                                                   stream=True)
    next(iter(stream))
    time.sleep(rng.uniform(0.0, 0.05))
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    server.stop()


def entry_files_are_whole(directory: Path) -> int:
    """Each ``*.kv`` file passes its header's length and checksum checks; returns how many there are."""
    files = list(directory.rglob("*.kv"))
    for path in files:
        read_header(path.read_bytes())
    return len(files)


def test_a_server_killed_while_writing_its_disk_tier_restarts_consistent_and_correct(tmp_path: Path) -> None:
    kill_and_restart(tmp_path, PROMPTS[:2], random.Random(3))


@pytest.mark.heavy
def test_a_server_killed_four_times_while_writing(tmp_path: Path) -> None:
    kill_and_restart(tmp_path, PROMPTS, random.Random(4))


def kill_and_restart(tmp_path: Path, prompts: list[str], rng: random.Random) -> None:
    from kvserve.offline import LLM
    from kvserve.sampling_params import SamplingParams

    disk_dir = tmp_path / "kv"
    args = ENGINE_ARGS + ["--kv-disk-dir", str(disk_dir)]
    servers: list[ServerProcess] = []
    try:
        servers.append(ServerProcess(args, tmp_path / "server0.log"))
        # The reference, computed while the server starts: the same engine without tiers.
        llm = LLM(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=512)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        expected = [out.outputs[0].text for out in llm.generate(prompts, params)]
        llm.close()
        # Each life answers the prompts so far (earlier lives wrote them: they load from disk, whatever
        # of them survived, and must answer right), then is killed while writing the next prompt's blocks.
        for life in range(len(prompts)):
            server = servers[-1]
            server.wait_ready()
            for i, prompt in enumerate(prompts[: life + 1]):
                text, from_disk = answer(server, prompt)
                assert text == expected[i], (life, i)
                if i < life:
                    assert from_disk > 0, (life, i)  # written in full by an earlier life before its kill
            if life == len(prompts) - 1:
                break
            kill_while_writing(server, prompts[life + 1], rng)
            assert entry_files_are_whole(disk_dir) > 0
            servers.append(ServerProcess(args, tmp_path / f"server{life + 1}.log"))
        assert not list(disk_dir.rglob(".tmp-*"))  # a killed write's temporary file is deleted at start
    finally:
        for server in servers:
            server.stop()
    for server in servers:
        assert "Traceback" not in server.log_tail(10**7), server.log_tail()
