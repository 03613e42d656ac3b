"""The mixture-of-experts feed-forward block of Mixtral, Qwen2-MoE and Qwen3-MoE.

Routing follows transformers' modeling code: the router's logits (in the model's dtype), a softmax over
all experts in float32, the top k, renormalised to sum to one where the family does (``norm_topk_prob``;
Mixtral always, which is the softmax over its k largest logits). The routed experts run grouped by expert:
the (token, expert) assignments are sorted by expert, every expert that got any runs once on its gathered
rows through the backend's ops, and each token sums its k results weighted in float32. Qwen2-MoE adds a
shared expert that every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``.

transformers accumulates the weighted expert outputs in the model's dtype (and Qwen rounds the routing
weights to it first); here they are summed in float32 and rounded once, so bf16 results may differ from
it in the last bit. In float32 the two agree up to the order of a k-term sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.config import ArchConfig
from kvserve.model.lora import LayerLoRA
from kvserve.model.mlp import GatedMLP, Take
from kvserve.model.ops import ModelOps


@dataclass(frozen=True, slots=True)
class Routing:
    """Which experts each token goes to, and with what weight."""

    expert_ids: torch.Tensor  # [num_tokens, top_k] int64
    weights: torch.Tensor  # [num_tokens, top_k] float32


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """logits: [num_tokens, num_experts], the router's output in the model's dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(expert_ids, weights)


def grouped_experts(x: torch.Tensor, routing: Routing, experts: Sequence[GatedMLP]) -> torch.Tensor:
    """sum_j weights[t, j] * experts[expert_ids[t, j]](x[t]) for every token t, each expert run once.

    x: [num_tokens, hidden] -> [num_tokens, hidden] in x's dtype.
    """
    num_tokens, top_k = routing.expert_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    assignments = routing.expert_ids.flatten()  # [num_tokens * top_k]: slot t * top_k + j
    # Stable, so an expert's rows keep token order and a token's result does not depend on its batch.
    order = torch.argsort(assignments, stable=True)
    counts = torch.bincount(assignments, minlength=len(experts)).tolist()  # the layer's one host sync
    rows = x.index_select(0, order // top_k)  # [num_tokens * top_k, hidden], grouped by expert
    outputs: list[torch.Tensor] = []
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count:
            outputs.append(expert.forward(rows[start : start + count]))
            start += count
    grouped = torch.cat(outputs)  # [num_tokens * top_k, hidden], rows in `order`
    # Scatter each result back to its (token, slot) place, then add up a token's k slots: a fixed order of
    # additions (index_add_ on a GPU would add in whatever order its atomics land).
    slots = torch.empty_like(grouped).index_copy_(0, order, grouped)
    weighted = slots.view(num_tokens, top_k, -1).float() * routing.weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


class MoeMLP:
    """Router, routed experts and, where the family has one, the shared expert and its gate."""

    def __init__(self, ops: ModelOps, top_k: int, normalize: bool, router_weight: torch.Tensor,
                 experts: list[GatedMLP], shared_expert: GatedMLP | None = None,
                 shared_expert_gate: torch.Tensor | None = None) -> None:
        self.ops = ops
        self.top_k = top_k
        self.normalize = normalize
        self.router_weight = router_weight  # [num_experts, hidden]
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate  # [1, hidden]

    @classmethod
    def load(cls, arch: ArchConfig, ops: ModelOps, prefix: str, take: Take) -> MoeMLP:
        """From the Hugging Face names under ``prefix`` (``model.layers.{i}.mlp.``): ``gate.weight`` (the
        router), ``experts.{e}.{gate,up,down}_proj.weight``, ``shared_expert.*`` and ``shared_expert_gate``."""
        experts = [GatedMLP.load(ops, f"{prefix}experts.{e}.", take) for e in range(arch.num_experts)]
        shared = GatedMLP.load(ops, prefix + "shared_expert.", take) if arch.num_shared_experts else None
        # llama.cpp stores the shared expert's gate as a vector.
        gate = take(prefix + "shared_expert_gate.weight").reshape(1, -1) if arch.shared_expert_gate else None
        return cls(ops, arch.num_experts_per_token, arch.norm_topk_prob, take(prefix + "gate.weight"), experts,
                   shared, gate)

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]. Adapters never target experts (refused at load)."""
        ops = self.ops
        routing = route(ops.linear(x, self.router_weight, None), self.top_k, self.normalize)
        out = grouped_experts(x, routing, self.experts)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(ops.linear(x, self.shared_expert_gate, None)) * shared
            out = out + shared
        return out

    def prepare(self) -> None:
        self.ops.prepare_weight(self.router_weight)
        for expert in self.experts:
            expert.prepare()
        if self.shared_expert is not None:
            self.shared_expert.prepare()

    def tensors(self) -> list[torch.Tensor]:
        tensors = [self.router_weight]
        for expert in self.experts:
            tensors += expert.tensors()
        if self.shared_expert is not None:
            tensors += self.shared_expert.tensors()
        if self.shared_expert_gate is not None:
            tensors.append(self.shared_expert_gate)
        return tensors
