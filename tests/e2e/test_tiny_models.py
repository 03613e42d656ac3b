"""kvserve equals transformers token for token on tiny random Llama, Mistral, Qwen2 and Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_cpu_kernels
from tests.e2e.conftest import hf_greedy
from tests.support.tiny_models import gguf_from_tiny_model, make_tiny_model

PROMPTS = [[5, 17, 230, 4000, 12], list(range(100, 161)), [9] * 23, list(range(3000, 3200, 3))]
MAX_TOKENS = 12


@pytest.mark.parametrize(
    ("family", "tie"), [("llama", True), ("mistral", False), ("qwen2", True), ("qwen2", False), ("qwen3", False),
                        ("smollm3", True), ("granite", True), ("phi3", False)]
)
def test_tiny_model_matches_transformers(tmp_path, family: str, tie: bool) -> None:
    """SmolLM3's fourth layer has no rotary (NoPE); Granite scales its embeddings, the blocks' outputs as they
    join the residual stream, its attention and its logits; Phi-3 holds QKV and gate/up fused, rotates half of
    each head (Phi-4-mini's shape) with LongRoPE's short factors and magnitude. Their GGUFs, as llama.cpp's
    converter writes them (Q and K permuted but Phi-3's; no key saying which of SmolLM3's layers go without),
    give the same tokens."""
    import transformers

    model_dir = make_tiny_model(tmp_path, family, tie=tie)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = [hf_greedy(reference_model, p, MAX_TOKENS) for p in PROMPTS]
    also_as_gguf = ("smollm3", "granite", "phi3")
    sources = [model_dir] + ([gguf_from_tiny_model(model_dir, tmp_path / "m.gguf")] if family in also_as_gguf else [])
    for source in sources:
        # Small blocks and a small token budget exercise paging, chunked prefill and mixed batches.
        llm = LLM(str(source), dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=24,
                  enable_prefix_caching=True)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        if family in also_as_gguf:  # the prompt's logprobs show what the tokens of a tiny random model may not
            _check_prompt_logprobs(reference_model, llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                 SamplingParams(max_tokens=1, prompt_logprobs=0)))
        llm.engine.check_invariants()


def test_phi3_with_a_sliding_window_and_three_quarters_of_each_head_rotating_matches_transformers(tmp_path) -> None:
    """Phi-3-mini-4k's window over every layer (shorter than the prompts here), with Phi-4-mini's partial
    rotary at 3/4 of each head: the loader's reordering of Q and K rows leaves the attention as it was."""
    import transformers

    model_dir = make_tiny_model(tmp_path, "phi3", tie=False, sliding_window=8, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for source in (model_dir, gguf_from_tiny_model(model_dir, tmp_path / "phi3.gguf")):
        llm = LLM(str(source), dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=24)
        arch = llm.engine.arch
        assert arch.sliding_window == 8 and arch.rotary_dim == 12 and arch.fused_projections
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference_model, p, MAX_TOKENS)
                                                              for p in PROMPTS]
        _check_prompt_logprobs(reference_model, llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                             SamplingParams(max_tokens=1, prompt_logprobs=0)))


def test_smollm3_with_its_sliding_window_matches_transformers(tmp_path) -> None:
    """SmolLM3's use_sliding_window: its layers without rotary see only the last keys of a window shorter than
    the prompts (transformers' layer_types); the others everything."""
    import transformers

    model_dir = make_tiny_model(tmp_path, "smollm3", use_sliding_window=True, sliding_window=8)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=24)
    assert llm.engine.arch.sliding_window == 8 and llm.engine.arch.sliding_layers == (3,)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference_model, p, MAX_TOKENS) for p in PROMPTS]
    _check_prompt_logprobs(reference_model, llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                         SamplingParams(max_tokens=1, prompt_logprobs=0)))


@pytest.mark.parametrize("cpu_kernels", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ kernels did not build")),
], ids=["torch-reference", "cpu-kernel"])
def test_decodes_sharing_a_cached_prefix_match_transformers(tmp_path, monkeypatch, cpu_kernels) -> None:
    """Requests whose prompts share cached blocks decode with the shared-prefix (cascade) attention path."""
    import transformers

    from kvserve.model.attention import TorchPagedAttention
    from kvserve.model.backends.cpu_attention import CpuKernelPagedAttention

    model_dir = make_tiny_model(tmp_path, "qwen3", tie=False)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    shared = list(range(500, 542))
    prompts = [shared + [7 + i, 900 + i] for i in range(4)]
    reference = [hf_greedy(reference_model, p, MAX_TOKENS) for p in prompts]

    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128, enable_prefix_caching=True,
              cpu_kernels=cpu_kernels, cascade_min_tokens=8)
    calls = []
    backend, method = ((CpuKernelPagedAttention, "_shared_prefix_flash") if cpu_kernels
                       else (TorchPagedAttention, "_decode_shared_prefix"))
    assert type(llm.engine.model.layers[0].attention) is backend
    original = getattr(backend, method)
    monkeypatch.setattr(backend, method, lambda self, *a: calls.append(1) or original(self, *a))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0]}, params)  # caches the shared blocks
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert calls, "the shared-prefix decode path never ran"


@pytest.mark.parametrize("family, rope", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
    ("qwen2", {"rope_type": "linear", "factor": 64.0, "rope_theta": 10000.0}),
    ("gemma3", {"full_attention": {"rope_type": "linear", "factor": 64.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # YaRN (Qwen2.5's and Qwen3's long context): an original context short enough that the ramp between
    # kept and interpolated frequencies falls inside the head; transformers' defaults, then every field set.
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 1000000.0}),
    ("qwen3", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
               "beta_slow": 2.0, "attention_factor": 1.25, "rope_theta": 50000.0}),
    ("llama", {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32, "mscale": 1.0,
               "mscale_all_dim": 0.5, "truncate": False, "rope_theta": 10000.0}),
], ids=["llama3", "linear", "gemma3-linear-full-attention", "yarn", "yarn-attention-factor-betas",
        "yarn-mscale-untruncated"])
def test_stretched_rotary_frequencies_match_transformers(tmp_path, family: str, rope: dict) -> None:
    """Llama 3.1's llama3 scaling, linear scaling (Gemma 3 4B+ on its full-attention layers only) and YaRN
    change every position's rotation: computed as transformers computes them, the tokens are its tokens (they
    were a logged warning before, and other tokens; YaRN was refused). A YaRN model's GGUF, with the keys
    llama.cpp's converter writes, gives the same."""
    import transformers

    model_dir = make_tiny_model(tmp_path, family, rope_parameters=rope)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = [hf_greedy(reference_model, p, MAX_TOKENS) for p in PROMPTS]
    sources = [model_dir]
    if rope.get("rope_type") == "yarn" and "mscale" not in rope:  # llama.cpp has no key for mscale's pair
        sources.append(gguf_from_tiny_model(model_dir, tmp_path / "yarn.gguf"))
    for source in sources:
        _check_stretched_rotary(LLM(str(source), dtype="float32", block_size=4, num_kv_blocks=128),
                                reference_model, reference)


def _check_stretched_rotary(llm: LLM, reference_model, reference: list[list[int]]) -> None:
    assert llm.engine.arch.rope_scaling is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    _check_prompt_logprobs(reference_model, outputs)


def _check_prompt_logprobs(reference_model, outputs) -> None:
    """The prompt's logprobs against transformers' (the tokens alone barely depend on position in a tiny random
    model)."""
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = reference_model(torch.tensor([prompt])).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1)
        ours = [entry[token] for token, entry in zip(prompt[1:], output.prompt_logprobs[1:], strict=True)]
        theirs = [expected[i, token].item() for i, token in enumerate(prompt[1:])]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


def test_prompt_logprobs_leave_out_an_output_projections_padded_rows(tmp_path) -> None:
    """Rows past the vocabulary (checkpoints pad them) are never sampled; prompt logprobs left them in their
    normaliser, their ranks and their top tokens. Padded with rows that would win every position: the same
    prompt logprobs as the unpadded model's."""
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path, "llama", tie=True)
    padded = tmp_path / "padded"
    padded.mkdir()
    for file in model_dir.iterdir():
        (padded / file.name).write_bytes(file.read_bytes())
    tensors = load_file(padded / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = torch.cat([embed, 50 * embed[:8]])
    save_file(tensors, padded / "model.safetensors")

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    def prompt_logprobs(path) -> list:
        output = LLM(str(path), dtype="float32", enable_prefix_caching=False).generate(
            [{"prompt_token_ids": PROMPTS[1]}], params)[0]
        return [{t: round(value, 4) for t, value in entry.items()} if entry else entry
                for entry in output.prompt_logprobs] + [output.prompt_token_ranks]

    assert prompt_logprobs(padded) == prompt_logprobs(model_dir)


def test_priority_scheduling_admits_and_preempts_by_priority_and_keeps_every_token(tmp_path) -> None:
    """Short of blocks, the priority policy preempts the least urgent requests; every output is still the one
    a roomy pool gives. Other policies take priority 0 only."""
    from dataclasses import replace

    from kvserve.errors import InvalidSamplingParams

    model_dir = make_tiny_model(tmp_path, "llama", tie=True)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, priority=p) for p in (2, 0, 1, -1)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    roomy = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, [replace(p, priority=0) for p in params])]
    with pytest.raises(InvalidSamplingParams, match="--scheduling-policy priority"):
        roomy.generate(prompts[:1], params[0])
    tight = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=30, scheduling_policy="priority")
    outputs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    preempted = [o.metrics.num_preemptions for o in outputs]
    assert preempted[3] == preempted[1] == 0 and preempted[0] > 0  # the two most urgent never; the least, yes
    tight.engine.check_invariants()
    again = tight.generate(prompts, [replace(p, priority=0) for p in params], priority=[2, 0, 1, -1])  # vLLM's way
    assert [o.outputs[0].token_ids for o in again] == expected
    assert [o.metrics.num_preemptions for o in again] == preempted
