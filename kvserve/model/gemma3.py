"""Gemma 3 (text): the Llama layout with Gemma's differences.

- the embedding is scaled by sqrt(hidden) (rounded to the model's dtype, as the reference does);
- RMSNorm multiplies by (1 + weight): the weights arrive in Hugging Face's form and ``1 +`` is applied once
  at load time, so the shared norm kernels apply;
- four norms per layer: before and after attention, before and after the MLP;
- QK-norm, a GELU-tanh gated MLP, and attention scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers (their own rope base, keys limited to the window) interleaved with global ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvserve.config import ArchConfig
from kvserve.model.backends.base import AttentionMetadata, Backend, DecoderLayout, PagedAttention
from kvserve.model.layers import RotaryEmbedding
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM
from kvserve.model.lora import LayerLoRA
from kvserve.model.mlp import FeedForward, GeluGatedMLP, Take
from kvserve.model.ops import ModelOps
from kvserve.model.quantized import Weight


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, arch: ArchConfig, attention: PagedAttention, ops: ModelOps, sliding: bool) -> None:
        super().__init__(arch, attention, ops)
        self.sliding = sliding
        self.pre_feedforward_norm: torch.Tensor  # [hidden], 1 + weight
        self.post_feedforward_norm: torch.Tensor

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: LayerLoRA | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what this layer adds to the residual stream, the stream before it), as the Llama layer returns."""
        eps, ops = self.arch.rms_norm_eps, self.ops
        x, residual = ops.add_rms_norm(hidden, residual, self.input_norm, eps)
        attn = self.attend(x, cos, sin, meta, kv_cache, lora)
        attn = ops.add_rms_norm(self.project_out(attn, lora), None, self.post_attention_norm, eps)[0]
        x, residual = ops.add_rms_norm(attn, residual, self.pre_feedforward_norm, eps)
        return ops.add_rms_norm(self.mlp.forward(x, lora), None, self.post_feedforward_norm, eps)[0], residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    # Four norms per layer and a GELU MLP: not Llama's layout (a fused decode runs the layers' own forwards).
    llama_layers = False

    def __init__(self, arch: ArchConfig, backend: Backend, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(arch, backend, dtype, device)
        self.layers: list[Gemma3DecoderLayer]
        self.local_rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                            arch.rope_local_theta or arch.rope_theta, dtype, device)
        # The reference multiplies by sqrt(hidden) cast to the weights' dtype.
        self.embed_scale = torch.tensor(arch.hidden_size**0.5, dtype=dtype, device=device)

    def make_layer(self, layer_index: int) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(self.arch, self.backend.make_attention(layer_index), self.ops,
                                  sliding=self.arch.layer_window(layer_index) is not None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(input_ids, self.embed_tokens) * self.embed_scale

    def rotations(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.rotary.lookup(positions), self.local_rotary.lookup(positions)]

    def decoder_layout(self) -> DecoderLayout:
        return DecoderLayout(llama_layers=False, layer_rotations=tuple(int(layer.sliding) for layer in self.layers))

    def compute_logits(self, hidden: torch.Tensor, head: Weight | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, head)
        cap = self.arch.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        extra: dict[str, torch.Tensor] = {}
        super().load_weights(self._take_extra_norms(weights, extra))
        for i, layer in enumerate(self.layers):
            layer.pre_feedforward_norm = self._one_plus(extra.pop(f"model.layers.{i}.pre_feedforward_layernorm.weight"))
            layer.post_feedforward_norm = self._one_plus(
                extra.pop(f"model.layers.{i}.post_feedforward_layernorm.weight"))
            layer.input_norm = self._one_plus(layer.input_norm)
            layer.post_attention_norm = self._one_plus(layer.post_attention_norm)
            if layer.q_norm is not None and layer.k_norm is not None:
                layer.q_norm, layer.k_norm = self._one_plus(layer.q_norm), self._one_plus(layer.k_norm)
        self.final_norm = self._one_plus(self.final_norm)

    def load_mlp(self, layer_index: int, prefix: str, take: Take) -> FeedForward:
        return GeluGatedMLP.load(self.ops, prefix, take)

    @staticmethod
    def _take_extra_norms(weights: Iterable[tuple[str, torch.Tensor]],
                          into: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights the Llama loader knows; the feed-forward norms it does not are kept aside in ``into``."""
        for name, tensor in weights:
            if name.endswith(("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")):
                into[name] = tensor
            else:
                yield name, tensor

    def _one_plus(self, weight: torch.Tensor) -> torch.Tensor:
        # In float32, as the reference computes 1 + weight, then in the model's dtype.
        return (1.0 + weight.float()).to(device=self.device, dtype=self.dtype)
