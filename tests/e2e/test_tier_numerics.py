"""KV in a shared tier is read only by engines that compute the model the same way: the default model's GGUF
blocks with int16 activations, with int8 ones, and dequantised to bf16 are three approximations of one model,
and a prefix one of them stored is a miss for the others (and a hit for its own kind after a restart)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.loader import resolve_model_path
from kvserve.tokenizer import Tokenizer
from tests.e2e.conftest import LONG_DOCUMENT

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def disk_hits(disk_dir: Path, prompt: list[int], **settings: str) -> tuple[int, str]:
    """Tokens the disk tier gave one request on a fresh engine, and the engine's numerics; the engine writes
    every full block it computes through to the tier."""
    llm = LLM(dtype="bfloat16", num_kv_blocks=32, kv_disk_gb=0.05, kv_disk_dir=str(disk_dir),
              kv_write_policy="write_through", **settings)
    try:
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        llm.engine.check_invariants()
        assert llm.engine.tiers is not None
        return out.metrics.cached_tokens_by_tier.get("disk", 0), llm.engine.tiers.namespace.numerics
    finally:
        llm.close()


def test_engines_computing_the_model_another_way_do_not_read_each_others_kv(tmp_path: Path) -> None:
    disk_dir = tmp_path / "kv"
    tokenizer = Tokenizer.from_model_path(resolve_model_path(None))
    prompt = tokenizer.encode(LONG_DOCUMENT, add_special_tokens=False)[:80]  # five full blocks of 16
    assert disk_hits(disk_dir, prompt, quantization="gguf", quantized_activations="int16") == (0, "gguf")
    hits, numerics = disk_hits(disk_dir, prompt, quantization="gguf", quantized_activations="int8")
    # Where the CPU has no int8 kernels the int8 engine computes as the int16 one does, and shares its KV.
    assert (hits, numerics) in ((0, "gguf-int8"), (64, "gguf")), (hits, numerics)
    assert disk_hits(disk_dir, prompt, quantization="none") == (0, "dense")
    # Each kind finds its own: every full block but the one holding the last prompt token, recomputed for
    # its logits.
    assert disk_hits(disk_dir, prompt, quantization="gguf", quantized_activations="int16") == (64, "gguf")
    assert disk_hits(disk_dir, prompt, quantization="none") == (64, "dense")


def test_engines_on_one_redis_are_of_one_shared_group_only_when_they_compute_alike(redis_server) -> None:
    """What a gateway reads (``/kvserve/info``'s ``shared_kv_group``) to count a prefix in Redis as cheap on a
    replica: the same Redis and the same tier namespace."""
    def group(**settings: str) -> str | None:
        llm = LLM(dtype="bfloat16", num_kv_blocks=32, kv_redis_url=redis_server.url, **settings)
        try:
            return llm.engine.shared_kv_group
        finally:
            llm.close()

    default = group(quantization="gguf", quantized_activations="int16")
    assert default is not None and default == group(quantization="gguf", quantized_activations="int16")
    assert group(quantization="none") not in (default, None)
    assert LLM(dtype="bfloat16", num_kv_blocks=32).engine.shared_kv_group is None
