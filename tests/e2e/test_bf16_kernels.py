"""bf16 on the real model: the C++ kernels (GEMV/AMX projections, paged prefill and decode attention, the fused
decode stack, cascade decode) against transformers in float32 on the same GGUF weights.

kvserve generates greedily in bf16 and returns, at every step, the logprobs of its top 5 tokens; transformers
scores the same sequences in float32 (teacher-forced along kvserve's own tokens, so a legitimate divergence
at a near-tie does not end the comparison). Tolerances, in nats:

- ``MEAN_TOP5_NATS``: the mean |kvserve - reference| over the top-5 logprobs of every step. Rounding
  weights and activations to bf16 (8 significant bits) moves this model's logprobs by about 0.06 on average;
  transformers' own bf16 run is off from its float32 run by as much as correct kernels are, which is the
  reason for the bound. A kernel that is wrong everywhere but slightly (one attention output scaled by 0.9,
  in prefill, in decode, in the fused stack or only in cascade's shared-prefix half) about triples it.
- ``MAX_CHOSEN_NATS``: each chosen token's logprob, at every step: one bad step (a dropped block, a wrong
  tile) cannot hide in a mean. Correct bf16 paths stay under two thirds of it.
- ``MAX_DEFICIT_NATS``: how far below the reference's best the chosen token's reference logprob may be:
  greedy bf16 may leave the float32 path only at a near-tie, and an argmax that picks a worse token fails.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.request import CompletionOutput
from tests.e2e.conftest import CHAT_QUESTIONS, PLAIN_PROMPTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ CPU kernels did not build on this machine"),
]
MAX_TOKENS = 24
TOP_LOGPROBS = 5
MEAN_TOP5_NATS = 0.1
MAX_CHOSEN_NATS = 0.3
MAX_DEFICIT_NATS = 0.3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)

SYSTEM = ("You are a careful assistant for a team of engineers. Answer briefly, cite the numbers you use, "
          "and say so when you are unsure. Prefer plain words over jargon, and short lists over long prose. ") * 8


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="bfloat16", num_kv_blocks=512, cpu_kernels=True)


def common_prefix_length(sequences: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n for s in sequences) and len({s[n] for s in sequences}) == 1:
        n += 1
    return n


def reference_logprobs(model, sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per (prompt, output): the float32 log-softmax at each output position, [len(output), vocab], with
    the output teacher-forced. The sequences' common start is computed once and its KV cache reused."""
    inputs = [prompt + output[:-1] for prompt, output in sequences]
    shared = min(common_prefix_length(inputs), min(len(prompt) for prompt, _ in sequences) - 1)
    out = []
    with torch.no_grad():
        cache = None
        if shared:
            cache = model(input_ids=torch.tensor([inputs[0][:shared]]), use_cache=True).past_key_values
        for (_, output), ids in zip(sequences, inputs, strict=True):
            result = model(input_ids=torch.tensor([ids[shared:]]), past_key_values=copy.deepcopy(cache),
                           use_cache=True, logits_to_keep=len(output))
            out.append(torch.log_softmax(result.logits[0].float(), dim=-1))
    return out


def assert_matches_reference(model, prompts: list[list[int]], outputs: list[CompletionOutput]) -> None:
    references = reference_logprobs(model, [(p, o.token_ids) for p, o in zip(prompts, outputs, strict=True)])
    diffs: list[float] = []
    for index, (output, reference) in enumerate(zip(outputs, references, strict=True)):
        assert output.logprobs is not None and len(output.token_ids) == MAX_TOKENS
        for step, (token, top) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
            where = f"request {index}, step {step}"
            step_diffs = [abs(lp - float(reference[step, t])) for t, lp in top.items()]
            diffs.extend(step_diffs)
            chosen = abs(top[token] - float(reference[step, token]))
            assert chosen <= MAX_CHOSEN_NATS, f"{where}: chosen token's logprob off by {chosen:.3f}"
            deficit = float(reference[step].max() - reference[step, token])
            assert deficit <= MAX_DEFICIT_NATS, f"{where}: chose a token {deficit:.3f} below the reference's best"
    mean = sum(diffs) / len(diffs)
    assert mean <= MEAN_TOP5_NATS, f"top-{TOP_LOGPROBS} logprobs off by {mean:.4f} on average"


def test_bf16_kernels_match_transformers(llm: LLM, hf_reference) -> None:
    """One-row decode (GEMV), batched decode and prefill, a prompt over 600 tokens: all against float32."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PLAIN_PROMPTS]
    prompts += [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
                for q in CHAT_QUESTIONS]
    single = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0].outputs[0]  # one-row decode
    batch = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert_matches_reference(hf_reference, [prompts[0], *prompts], [single, *batch])


def test_bf16_cascade_decode_matches_transformers(llm: LLM, hf_reference) -> None:
    """16 chats under one long system prompt: their decodes share its blocks, so attention splits into the
    shared prefix for all 16 x 9 query heads at once (the AMX kernel) and each request's own suffix, merged
    by log-sum-exp."""
    tok = llm.get_tokenizer()
    questions = (CHAT_QUESTIONS * 16)[:16]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": f"{i}. {q}"}]),
                          add_special_tokens=False) for i, q in enumerate(questions)]
    assert common_prefix_length(prompts) >= 300  # well above the runner's default cascade threshold (256)
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert_matches_reference(hf_reference, prompts, outputs)
