"""Cascade decode keeps each layer's shared prefix packed across steps (bf16, AMX). The kernel gives the same
bits with pre-packed keys as when it packs them itself, so an engine that keeps them must produce exactly
the tokens of one that packs every step: here over two rounds with different prefixes in a pool so small
that the second round evicts the first's blocks. (That a block rewritten under the same id gets a new key
is tested on BlockVersions and on the backend, in tests/test_block_versions.py and test_cpu_kernels.py:
the allocator does not hand the same ids back in the same order here.)"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.attention import CpuKernelPagedAttention
from kvserve.model.cpu_kernels import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.amx, reason="no AMX kernels on this machine")


def two_rounds(keep_packed: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[tuple], int]:
    """Greedy tokens of both rounds, the prefix keys asked for, and how often a kept packing was found.
    Not keeping: nothing is ever stored, so every step packs inside the kernel."""
    keys: list[tuple] = []
    reused = 0
    original_pack, original_kept = CpuKernelPagedAttention.packed_prefix_for, CpuKernelPagedAttention.kept_prefix

    def pack(self, k_cache, v_cache, runs, key):
        keys.append(key)
        return original_pack(self, k_cache, v_cache, runs, key) if keep_packed else None

    def kept(self, k_cache, key):
        nonlocal reused
        found = original_kept(self, k_cache, key)
        reused += found is not None
        return found

    monkeypatch.setattr(CpuKernelPagedAttention, "packed_prefix_for", pack)
    monkeypatch.setattr(CpuKernelPagedAttention, "kept_prefix", kept)
    # 27 blocks of 16: the second round's prefix can only be cached by evicting the first's blocks.
    llm = LLM(dtype="bfloat16", num_kv_blocks=27, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = []
    for base in (1000, 20000):
        prefix = list(range(base, base + 300))
        prompts = [{"prompt_token_ids": prefix + [base + 400 + i, base + 500 + i]} for i in range(4)]
        llm.generate(prompts[0], params)  # caches the prefix blocks
        outputs += [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_invariants()
    return outputs, keys, reused


def test_kept_packed_prefix_gives_the_tokens_of_packing_every_step(monkeypatch) -> None:
    kept, keys, reused = two_rounds(keep_packed=True, monkeypatch=monkeypatch)
    repacked, _, _ = two_rounds(keep_packed=False, monkeypatch=monkeypatch)
    assert kept == repacked
    assert all(key is not None for key in keys)
    assert len(set(keys)) >= 2, "both prefixes should have been packed"
    assert reused > 0, "a packed prefix should have been reused across steps"
