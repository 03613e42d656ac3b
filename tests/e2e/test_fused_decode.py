"""The fused decode stack (csrc/decode_stack.cpp) on the real model, on this CPU's packed projection family:
every decode step it runs must give bit for bit the hidden states of the Python layers on the same inputs,
for one row (AMX: the GEMV), many rows, and cascade decode over a shared prefix (AMX: packed on the fly the
first step, kept after)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.llama import LlamaForCausalLM
from tests.support.tiny_models import make_tiny_model

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.avx2, reason="no AVX2 kernels on this machine")


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", num_kv_blocks=512, block_size=16)


def test_fused_decode_matches_the_python_layers_bit_for_bit(llm, monkeypatch) -> None:
    model = llm.engine.runner.model
    stack = model.fused_decode
    assert stack is not None, "the packed projection kernels should give the model a fused decode stack"
    plain_forward = LlamaForCausalLM.forward
    checked: list[tuple[int, bool]] = []  # (rows, cascade) of each decode step compared

    def both_ways(self, input_ids, positions, meta, kv_caches, group_metas=(), lora=None):
        assert not group_metas, "SmolLM2 keeps one block table for every layer"
        assert lora is None, "no request runs a LoRA adapter"
        fused = plain_forward(self, input_ids, positions, meta, kv_caches)
        if stack.accepts(fused, (meta,)):
            self.fused_decode = None
            try:  # the same step again through the Python layers (rewriting the same KV)
                python = plain_forward(self, input_ids, positions, meta, kv_caches)
            finally:
                self.fused_decode = stack
            assert torch.equal(fused, python), f"fused decode differs at {len(input_ids)} rows"
            checked.append((len(input_ids), meta.decode_prefix_blocks is not None))
        return fused

    monkeypatch.setattr(LlamaForCausalLM, "forward", both_ways)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prefix = list(range(1000, 1400))  # 25 blocks every request shares
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    shared = [{"prompt_token_ids": prefix + [2000 + i, 3000 + i]} for i in range(6)]
    outputs = llm.generate(shared + [{"prompt_token_ids": [7, 8, 9 + i]} for i in range(2)], params)
    llm.generate(shared[:4], params)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert (1, False) in checked, "a one-row decode should have taken the fused stack"
    assert any(rows == 8 and not cascade for rows, cascade in checked)
    cascade_steps = [rows for rows, cascade in checked if cascade]
    assert cascade_steps.count(4) >= 3, "decodes sharing the prefix should run cascade steps, packed and kept"
    llm.engine.check_invariants()


def test_fused_decode_gives_the_tokens_of_the_python_layers() -> None:
    # The prefix cache off: with it, the second run would find its prompts cached and compute their last
    # tokens as one-token rows on the decode kernel, where the first computed them in the prefill kernel.
    llm = LLM(dtype="bfloat16", num_kv_blocks=512, block_size=16, enable_prefix_caching=False)
    model = llm.engine.runner.model
    stack = model.fused_decode
    tok = llm.get_tokenizer()
    system = "You are a terse assistant. Reply with short sentences and exact numbers. " * 12
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]),
        add_special_tokens=False)} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model.fused_decode = None
    try:
        python = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        model.fused_decode = stack
    assert fused == python


@pytest.mark.parametrize("family", ["smollm3", "granite", "phi3"])
def test_fused_decode_takes_the_layers_of_smollm3_granite_and_phi3(tmp_path, family: str) -> None:
    """SmolLM3's NoPE layers (every fourth): the stack skips their rotary; Granite's residual multiplier: the
    stack scales each block's output as the Python layers do; Phi-3's partial rotary and LongRoPE are in the
    tables the stack reads. The same tokens and logprobs either way (tiny random models with heads of 64,
    which the stack takes)."""
    model_dir = make_tiny_model(tmp_path, family, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=256)
    llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    model = llm.engine.runner.model
    stack = model.fused_decode
    assert stack is not None
    assert model.arch.no_rope_layers == ((3,) if family == "smollm3" else ())
    assert (model.arch.residual_multiplier != 1.0) == (family == "granite")
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 160 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    fused = llm.generate(prompts, params)
    model.fused_decode = None
    try:
        python = llm.generate(prompts, params)
    finally:
        model.fused_decode = stack
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in python]
    assert [o.outputs[0].logprobs for o in fused] == [o.outputs[0].logprobs for o in python]
