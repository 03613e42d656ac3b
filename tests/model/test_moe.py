"""kvserve.model.moe: routing, the grouped expert computation against a per-token reference, and the MoE
block against transformers' own Mixtral, Qwen2-MoE and Qwen3-MoE blocks on the same weights."""

from __future__ import annotations

import pytest
import torch

from kvserve.arch import ArchConfig
from kvserve.model.mlp import GatedMLP
from kvserve.model.moe import MoeMLP, Routing, grouped_experts, route
from kvserve.model.ops import ModelOps

HIDDEN, EXPERT_SIZE, NUM_EXPERTS = 32, 24, 6


def random_experts(generator: torch.Generator, num_experts: int = NUM_EXPERTS,
                   dtype: torch.dtype = torch.float32) -> list[GatedMLP]:
    return [GatedMLP(ModelOps(), torch.randn(2 * EXPERT_SIZE, HIDDEN, generator=generator).to(dtype) * 0.2,
                     torch.randn(HIDDEN, EXPERT_SIZE, generator=generator).to(dtype) * 0.2)
            for _ in range(num_experts)]


def per_token_reference(x: torch.Tensor, routing: Routing, experts: list[GatedMLP]) -> torch.Tensor:
    """The naive loop: every token through each of its experts, one row at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(routing.expert_ids[t].tolist(), routing.weights[t].tolist(), strict=True):
            gate_up, down = experts[e].gate_up_weight.double(), experts[e].down_weight.double()
            gate, up = (gate_up @ x[t].double()).chunk(2)
            out[t] += w * (down @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_grouped_experts_match_the_per_token_reference(top_k: int, num_tokens: int) -> None:
    generator = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    experts = random_experts(generator)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    # Expert 4 gets no token at all: an expert without rows must be skipped, not run on an empty batch.
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    logits[:, 4] = -1e4
    routing = route(logits, top_k, normalize=True)
    assert 4 not in routing.expert_ids.tolist()
    out = grouped_experts(x, routing, experts)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), per_token_reference(x, routing, experts), rtol=1e-5, atol=1e-5)


def test_grouped_experts_run_each_active_expert_once_on_its_rows() -> None:
    generator = torch.Generator().manual_seed(0)
    experts = random_experts(generator)
    calls: list[int] = []
    for e, expert in enumerate(experts):
        forward = expert.forward
        expert.forward = lambda rows, e=e, forward=forward: calls.append((e, rows.shape[0])) or forward(rows)  # type: ignore[method-assign]
    expert_ids = torch.tensor([[0, 2], [2, 5], [0, 5], [2, 0]])
    grouped_experts(torch.randn(4, HIDDEN, generator=generator),
                    Routing(expert_ids, torch.full((4, 2), 0.5)), experts)
    assert calls == [(0, 3), (2, 3), (5, 2)]


def test_a_token_gets_the_same_result_whatever_else_is_in_the_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    experts = random_experts(generator)
    x = torch.randn(30, HIDDEN, generator=generator)
    routing = route(torch.randn(30, NUM_EXPERTS, generator=generator), 2, normalize=False)
    alone = grouped_experts(x[7:8], Routing(routing.expert_ids[7:8], routing.weights[7:8]), experts)
    torch.testing.assert_close(grouped_experts(x, routing, experts)[7:8], alone)


def test_grouped_experts_in_bf16_sum_in_float32_and_round_once() -> None:
    generator = torch.Generator().manual_seed(2)
    experts = random_experts(generator, dtype=torch.bfloat16)
    x = torch.randn(16, HIDDEN, generator=generator).bfloat16()
    routing = route(torch.randn(16, NUM_EXPERTS, generator=generator).bfloat16(), 2, normalize=True)
    out = grouped_experts(x, routing, experts)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), per_token_reference(x, routing, experts), rtol=2e-2, atol=2e-2)


def test_routing_normalisations() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [0.0, 3.0, 3.5, -2.0]])
    raw = route(logits, 2, normalize=False)
    assert raw.expert_ids.tolist() == [[0, 3], [2, 1]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(raw.weights, probs.gather(1, raw.expert_ids))  # Qwen2-MoE: softmax over all
    # Renormalised (Mixtral, Qwen3-MoE): the softmax over the top-k logits alone.
    normalised = route(logits, 2, normalize=True)
    torch.testing.assert_close(normalised.weights, torch.softmax(logits.gather(1, raw.expert_ids), dim=-1))
    # bf16 logits: the softmax and the weights are float32, as in transformers' routers.
    assert route(logits.bfloat16(), 2, normalize=True).weights.dtype == torch.float32


# ---- the whole block against transformers --------------------------------------------------------------


def hf_block_and_arch(family: str):
    """transformers' sparse MoE block of ``family`` with random weights, and the ArchConfig kvserve reads
    from the same config."""
    import transformers

    common = dict(hidden_size=HIDDEN, intermediate_size=EXPERT_SIZE, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, vocab_size=64)
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        config = transformers.MixtralConfig(**common, num_local_experts=NUM_EXPERTS)
    elif family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        config = transformers.Qwen2MoeConfig(**common, num_experts=NUM_EXPERTS, moe_intermediate_size=EXPERT_SIZE,
                                             shared_expert_intermediate_size=40, norm_topk_prob=False)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        config = transformers.Qwen3MoeConfig(**common, num_experts=NUM_EXPERTS, moe_intermediate_size=EXPERT_SIZE,
                                             norm_topk_prob=True)
    config._experts_implementation = "eager"  # the per-expert loop of the modeling code
    torch.manual_seed(0)
    block = Block(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    from kvserve.formats.hf_config import arch_from_hf_config

    return block, arch_from_hf_config(config.to_dict(), "config.json")  # type: ignore[arg-type]


def moe_from_hf_block(block, arch: ArchConfig) -> MoeMLP:
    """kvserve's block on transformers' weights, as the loader hands them over (one tensor per expert)."""
    state = block.state_dict()
    names: dict[str, torch.Tensor] = {"gate.weight": state["gate.weight"]}
    size = arch.expert_size
    for e in range(arch.num_experts):
        gate_up = state["experts.gate_up_proj"][e]  # [2 * size, hidden]: gate rows, then up rows
        names |= {f"experts.{e}.gate_proj.weight": gate_up[:size], f"experts.{e}.up_proj.weight": gate_up[size:],
                  f"experts.{e}.down_proj.weight": state["experts.down_proj"][e]}
    names |= {k: v for k, v in state.items() if k.startswith("shared_expert")}
    mlp = MoeMLP.load(arch, ModelOps(), "", names.pop)
    assert not names, f"weights left over: {sorted(names)}"
    return mlp


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_block_matches_transformers(family: str) -> None:
    block, arch = hf_block_and_arch(family)
    assert arch.norm_topk_prob is (family != "qwen2_moe")
    assert (arch.num_shared_experts, arch.shared_expert_gate) == ((1, True) if family == "qwen2_moe" else (0, False))
    mlp = moe_from_hf_block(block, arch)
    x = torch.randn(1, 50, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = block(x)[0]
    torch.testing.assert_close(mlp.forward(x[0]), expected, rtol=1e-5, atol=1e-5)
    num_weights = sum(p.numel() for p in block.parameters())
    assert sum(t.numel() for t in mlp.tensors()) == num_weights == arch.moe_mlp_params(arch.num_experts)
