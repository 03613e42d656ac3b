"""kvserve equals transformers token for token on tiny random Mixtral, Qwen2-MoE and Qwen3-MoE models, from
their safetensors directories and from GGUF files of the same weights; in bf16 the CPU kernels run them
(without the fused decode stack) within bf16's error of the float32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model import moe
from kvserve.model.cpu_kernels import load_cpu_kernels
from tests.e2e.conftest import hf_greedy
from tests.support.tiny_models import MOE_FAMILIES, gguf_from_tiny_model, make_tiny_model

PROMPTS = [[5, 17, 230, 4000, 12], list(range(100, 161)), [9] * 23, list(range(3000, 3200, 3))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_moe")


def reference_tokens(model_dir: Path) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tiny_moe_model_matches_transformers(models_dir: Path, family: str) -> None:
    model_dir = make_tiny_model(models_dir, family, tie=family == "qwen3_moe")
    reference = reference_tokens(model_dir)

    # Small blocks and a small token budget: paging, chunked prefill, mixed prefill and decode batches.
    for prefix_caching in (True, False):
        llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=24,
                  enable_prefix_caching=prefix_caching)
        assert llm.engine.model.fused_decode is None
        assert generate(llm) == reference, f"prefix caching {prefix_caching}"
        if prefix_caching:
            assert generate(llm) == reference  # again, the prompts' blocks now come from the cache
            assert llm.engine.kv_manager.stats.hits > 0
        llm.engine.check_invariants()

    # The four requests need 53 blocks of 4 at the end; 30 cannot hold them all at once.
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=30, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    assert generate(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tiny_moe_gguf_matches_transformers(models_dir: Path, tmp_path: Path, family: str) -> None:
    """llama.cpp's layout of the same weights: stacked ffn_*_exps experts, Mixtral as "llama" with permuted
    Q/K rows, Qwen2-MoE's shared expert and its gate, Qwen2-MoE's dense layer told by its missing router."""
    model_dir = make_tiny_model(models_dir, family, tie=family == "qwen3_moe")
    path = gguf_from_tiny_model(model_dir, tmp_path / f"{family}.gguf")
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=24)
    assert llm.engine.arch.architecture == family
    assert generate(llm) == reference_tokens(model_dir)


def test_qwen3_moe_with_a_sparse_step_matches_transformers(models_dir: Path) -> None:
    """decoder_sparse_step 2: only every second layer routes (layer 1 of 0, 1, 2)."""
    model_dir = make_tiny_model(models_dir, "qwen3_moe", decoder_sparse_step=2)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=24)
    assert [type(layer.mlp).__name__ for layer in llm.engine.model.layers] == ["GatedMLP", "MoeMLP", "GatedMLP"]
    assert generate(llm) == reference_tokens(model_dir)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_router_decides_the_output(models_dir: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """The tiny models' routers are not near-uniform: tokens pick different experts, clearly, and sending
    every token to its least likely experts instead changes what the model generates."""
    import transformers

    model_dir = make_tiny_model(models_dir, family, tie=family == "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([sum(PROMPTS, [])]), output_router_logits=True)
    for logits in out.router_logits:  # one [num_tokens, num_experts] per routing layer
        probs = torch.softmax(logits.float(), dim=-1)
        top = probs.topk(2, dim=-1)
        assert len({tuple(sorted(pair)) for pair in top.indices.tolist()}) >= 10, "tokens share few expert pairs"
        assert float(top.values.sum(-1).mean()) > 0.5, "the top 2 of 8 experts should carry most of the weight"

    reference = reference_tokens(model_dir)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128)
    assert generate(llm) == reference
    right_route = moe.route
    monkeypatch.setattr(moe, "route", lambda logits, top_k, normalize: right_route(-logits, top_k, normalize))
    wrong = generate(llm)
    assert sum(a != b for a, b in zip(wrong, reference, strict=True)) >= 3


@pytest.mark.skipif(not (kernels := load_cpu_kernels()) or not (kernels.gemv_bf16 or kernels.avx512 or kernels.avx2),
                    reason="no bf16 projection kernels on this machine (they need AVX2 and FMA)")
def test_bf16_moe_on_the_cpu_kernels_stays_near_float32(models_dir: Path) -> None:
    """head_dim 64 and a plain layout (Mixtral) is what the fused decode stack takes for a dense model: the
    plan refuses it here, and the grouped experts go through the kernels' projections (GEMV for one row)."""
    import transformers

    from tests.e2e.test_bf16_kernels import MAX_TOKENS as BF16_TOKENS
    from tests.e2e.test_bf16_kernels import TOP_LOGPROBS, assert_matches_reference

    model_dir = make_tiny_model(models_dir, "mixtral", tie=False, hidden_size=256)  # 4 heads of 64
    llm = LLM(str(model_dir), dtype="bfloat16", block_size=16, num_kv_blocks=128, cpu_kernels=True)
    assert llm.engine.model.fused_decode is None
    if "amx attention" in llm.engine.model.backend.description:  # an AMX CPU: the stack would apply but for MoE
        assert "no fused decode stack: a mixture of experts" in llm.engine.model.backend.description
    params = SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    single = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].outputs[0]  # one-row decodes
    batch = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_matches_reference(reference, [PROMPTS[0], *PROMPTS], [single, *batch])
