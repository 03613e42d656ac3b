"""Cascade decode keeps each layer's shared prefix packed across steps (bf16, AMX). The kernel gives the same
bits with pre-packed keys as when it packs them itself, so an engine that keeps them must produce exactly
the tokens of one that packs every step: here over two rounds with different prefixes in a pool so small
that the second round evicts the first's blocks. (That a block rewritten under the same id gets a new key
is tested on BlockVersions and on the attention, in tests/test_block_versions.py and test_cpu_kernels.py:
the allocator does not hand the same ids back in the same order here.)"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.backends.cpu_attention import CpuKernelPagedAttention
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

    def kept(self, key):
        nonlocal reused
        found = original_kept(self, key)
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



def shared_prefix_prefill(share: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[tuple]]:
    """Greedy tokens of prompts that arrive together with a common 300-token prefix, in two waves, and the
    (shared keys, key) of every prefill attention call that had a shared prefix to keep packed. Not
    sharing: the backend's threshold is out of reach, so every work item packs all its keys."""
    calls: list[tuple] = []
    original_prefill = CpuKernelPagedAttention._prefill

    def prefill(self, q, k, v, k_cache, v_cache, meta):
        if meta.prefill_prefix_table is not None:
            calls.append((meta.prefill_prefix_keys, meta.prefill_prefix_key))
        return original_prefill(self, q, k, v, k_cache, v_cache, meta)

    monkeypatch.setattr(CpuKernelPagedAttention, "_prefill", prefill)
    llm = LLM(dtype="bfloat16", max_num_batched_tokens=512, shared_prefill_min_tokens=None if share else 1 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prefix = list(range(3000, 3300))
    outputs = []
    for wave in range(2):  # the second wave finds the prefix cached, and packed since the first
        prompts = [{"prompt_token_ids": prefix + list(range(4000 + 100 * i + 40 * wave, 4040 + 100 * i + 40 * wave))}
                   for i in range(4)]
        outputs += [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_invariants()
    return outputs, calls


def test_prefill_chunks_on_a_kept_shared_prefix_give_the_tokens_of_packing_per_chunk(monkeypatch) -> None:
    shared, calls = shared_prefix_prefill(share=True, monkeypatch=monkeypatch)
    per_chunk, no_calls = shared_prefix_prefill(share=False, monkeypatch=monkeypatch)
    assert shared == per_chunk
    assert not no_calls
    # 18 full blocks of 16 in common, in whole steps of 32, in both waves' steps (30 layers each), under one
    # key: the second wave's chunks use the packing the first made.
    assert {keys for keys, _ in calls} == {288} and len(calls) >= 60
    assert len({key for _, key in calls}) == 1
