"""bf16 on the real model: the C++ kernels (GEMV/AMX projections, paged decode attention, fused norms)
against kvserve's torch reference paths, same weights, same batch.

bf16 results depend on summation order, so the two runs cannot be required to agree bit for bit; what
must hold is that every request's greedy continuation starts the same and almost all tokens agree.
A wrong kernel (a transposed tile, a dropped block, a bad rounding) derails text within a few tokens.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_cpu_kernels
from tests.e2e.conftest import CHAT_QUESTIONS, PLAIN_PROMPTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ CPU kernels did not build on this machine"),
]
MAX_TOKENS = 24


def greedy_ids(cpu_kernels: bool) -> list[list[int]]:
    llm = LLM(dtype="bfloat16", num_kv_blocks=512, cpu_kernels=cpu_kernels)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PLAIN_PROMPTS]
    prompts += [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
                for q in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    single = llm.generate({"prompt_token_ids": prompts[0]}, params)[0].outputs[0].token_ids  # one-row decode
    batch = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return [single, *batch]


SYSTEM = ("You are a careful assistant for a team of engineers. Answer briefly, cite the numbers you use, "
          "and say so when you are unsure. Prefer plain words over jargon, and short lists over long prose. ") * 6


def shared_prefix_greedy_ids(cascade: bool) -> list[list[int]]:
    """16 chats under one long system prompt, with the kernels: their decodes share its blocks, so with
    cascade on, attention splits into the shared prefix for all 16 x 9 query heads at once (the AMX kernel)
    and each request's own suffix, merged by log-sum-exp; with it off, each request reads its whole
    context. The prefill is the same either way, so the two must agree but for rounding near-ties."""
    llm = LLM(dtype="bfloat16", num_kv_blocks=512, cpu_kernels=True, cascade_min_tokens=256 if cascade else 1 << 30,
              shared_prefill_min_tokens=256)
    tok = llm.get_tokenizer()
    questions = (CHAT_QUESTIONS * 16)[:16]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": f"{i}. {q}"}]),
                          add_special_tokens=False) for i, q in enumerate(questions)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def assert_mostly_agree(kernel: list[list[int]], reference: list[list[int]]) -> None:
    common_prefix = []
    for got, expected in zip(kernel, reference, strict=True):
        n = 0
        while n < MAX_TOKENS and got[n] == expected[n]:
            n += 1
        common_prefix.append(n)
    assert min(common_prefix) >= 4, common_prefix
    assert sum(common_prefix) >= 0.75 * MAX_TOKENS * len(kernel), common_prefix


def test_bf16_kernels_agree_with_the_torch_paths() -> None:
    assert_mostly_agree(greedy_ids(cpu_kernels=True), greedy_ids(cpu_kernels=False))


def test_bf16_cascade_decode_agrees_with_whole_context_decode() -> None:
    assert_mostly_agree(shared_prefix_greedy_ids(cascade=True), shared_prefix_greedy_ids(cascade=False))
