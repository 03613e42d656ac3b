"""Mixture-of-experts models in the format readers and the loader: the ArchConfig of each family's
config.json and GGUF, their tensor names (Mixtral's own spelling, llama.cpp's stacked experts), and what
is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve.arch import ArchConfig
from kvserve.errors import UnsupportedModel
from kvserve.model.loader import iter_weights, read_arch_config
from kvserve.model.tensor_names import weight_names
from tests.support.tiny_models import (
    MOE_FAMILIES,
    TINY_EXPERT_SIZE,
    TINY_NUM_EXPERTS,
    gguf_from_tiny_model,
    make_tiny_model,
)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_moe_models")


def test_which_layers_route() -> None:
    shape = dict(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=6, num_heads=2, num_kv_heads=1,
                 head_dim=4, max_position_embeddings=64, num_experts=4, num_experts_per_token=2)
    assert ArchConfig("qwen3_moe", **shape).num_moe_layers == 6
    step = ArchConfig("qwen3_moe", **shape, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [step.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert step.num_moe_layers == 2
    deepseek_like = ArchConfig("deepseek_v3", **shape, num_dense_layers=2)
    assert [deepseek_like.is_moe_layer(i) for i in range(6)] == [False, False, True, True, True, True]
    assert not ArchConfig("llama", **dict(shape, num_experts=0)).is_moe_layer(3)


def test_qwen2_moe_counts_its_own_sized_gated_shared_expert() -> None:
    qwen = ArchConfig("qwen2_moe", vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4, max_position_embeddings=64, num_experts=4, num_experts_per_token=2,
                      moe_intermediate_size=6, num_shared_experts=1, shared_expert_intermediate_size=10,
                      shared_expert_gate=True)
    # routed experts of 3 x 8 x 6 = 144, the shared one of 3 x 8 x 10 = 240, router 8 x 4, shared gate 8
    assert qwen.layer_mlp_params(active=True) == [2 * 144 + 240 + 32 + 8]
    assert qwen.layer_mlp_params(active=False) == [4 * 144 + 240 + 32 + 8]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_config_json_of_each_family(models_dir: Path, family: str) -> None:
    model_dir = make_tiny_model(models_dir, family, tie=False)
    arch = read_arch_config(model_dir)
    assert arch.architecture == family and arch.is_moe
    assert (arch.num_experts, arch.num_experts_per_token, arch.expert_size) == (TINY_NUM_EXPERTS, 2, TINY_EXPERT_SIZE)
    assert arch.norm_topk_prob is (family != "qwen2_moe")
    assert arch.qkv_bias is (family == "qwen2_moe")
    assert arch.qk_norm is (family == "qwen3_moe")
    if family == "qwen2_moe":
        assert (arch.num_shared_experts, arch.shared_expert_size, arch.shared_expert_gate) == (1, 48, True)
        assert arch.mlp_only_layers == (1,) and arch.num_moe_layers == 2
    else:
        assert (arch.num_shared_experts, arch.shared_expert_gate, arch.num_moe_layers) == (0, False, 3)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_safetensors_and_gguf_give_the_checkpoint_tensors(models_dir: Path, tmp_path: Path, family: str) -> None:
    """Every name weight_names lists, with the checkpoint's values: Mixtral's block_sparse_moe.*.w1/w3/w2
    read as mlp.*.gate/up/down_proj, and llama.cpp's stacked experts split back into one tensor per expert."""
    from safetensors.torch import load_file

    model_dir = make_tiny_model(models_dir, family, tie=False)
    arch = read_arch_config(model_dir)
    stored = load_file(model_dir / "model.safetensors")
    names = weight_names(arch)
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in stored
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    loaded = dict(iter_weights(model_dir, arch, torch.float32, show_progress=False))
    assert sorted(loaded) == sorted(names)
    assert len(loaded) == len(stored)
    spelled = {name.replace(".block_sparse_moe.", ".mlp.").replace(".w1.", ".gate_proj.")
               .replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj."): value for name, value in stored.items()}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, spelled[name]), name

    path = gguf_from_tiny_model(model_dir, tmp_path / "m.gguf")
    from_gguf = read_arch_config(path)
    assert from_gguf.architecture == family
    for field in ("num_experts", "num_experts_per_token", "expert_size", "num_shared_experts", "shared_expert_size",
                  "shared_expert_gate", "norm_topk_prob", "mlp_only_layers", "qkv_bias", "qk_norm", "head_dim"):
        assert getattr(from_gguf, field) == getattr(arch, field), field
    assert list(dict(iter_weights(path, from_gguf, torch.float32, show_progress=False))) == weight_names(from_gguf)
    for name, tensor in iter_weights(path, from_gguf, torch.float32, show_progress=False):
        assert torch.equal(tensor.reshape(loaded[name].shape), loaded[name]), name


def test_a_shared_expert_gate_written_as_a_vector_loads_and_runs_as_the_matrix(models_dir: Path,
                                                                              tmp_path: Path) -> None:
    """llama.cpp writes Qwen2-MoE's shared expert gate as a vector ([hidden]); the loader's shape check took
    only [1, hidden] and refused files that had loaded."""
    model_dir = make_tiny_model(models_dir, "qwen2_moe", tie=False)
    matrix = gguf_from_tiny_model(model_dir, tmp_path / "matrix.gguf")
    vector = gguf_from_tiny_model(model_dir, tmp_path / "vector.gguf", vector_shared_gate=True)
    gate = "model.layers.0.mlp.shared_expert_gate.weight"
    arch = read_arch_config(vector)
    weights = dict(iter_weights(vector, arch, torch.float32, show_progress=False))
    assert weights[gate].shape == (arch.hidden_size,)
    expected = dict(iter_weights(matrix, read_arch_config(matrix), torch.float32, show_progress=False))[gate]
    assert torch.equal(weights[gate].reshape(expected.shape), expected)


def test_gguf_experts_are_dequantised_once_per_stacked_tensor(models_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.model import loader

    path = gguf_from_tiny_model(make_tiny_model(models_dir, "qwen3_moe", tie=False), tmp_path / "m.gguf")
    arch = read_arch_config(path)
    calls: list[str] = []
    dequantize = loader._dequantize
    monkeypatch.setattr(loader, "_dequantize", lambda p, info, data: calls.append(info.name) or dequantize(p, info, data))
    list(iter_weights(path, arch, torch.float32, show_progress=False))
    assert len(calls) == len(set(calls))
    assert calls.count("blk.2.ffn_down_exps.weight") == 1


# ---- what is refused -------------------------------------------------------------------------------------


def write_config(model_dir: Path, **fields: object) -> Path:
    config = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16}
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config | fields))
    return model_dir


def test_latent_attention_and_other_moe_shapes_are_refused(tmp_path: Path) -> None:
    assert read_arch_config(write_config(tmp_path / "ok")).is_moe
    deepseek = write_config(tmp_path / "ds", model_type="deepseek_v3", kv_lora_rank=512, n_routed_experts=4)
    with pytest.raises(UnsupportedModel, match="deepseek_v3"):
        read_arch_config(deepseek)
    with pytest.raises(UnsupportedModel, match="experts per token"):
        read_arch_config(write_config(tmp_path / "k", num_experts_per_tok=5))


def test_fused_expert_tensors_are_refused_by_name(models_dir: Path, tmp_path: Path) -> None:
    """transformers 5 keeps experts fused in memory ([num_experts, 2 * size, hidden]); a checkpoint saved that
    way is refused with the reason, not as a list of missing tensors."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "fused"
    shutil.copytree(make_tiny_model(models_dir, "qwen3_moe", tie=False), broken)
    tensors = load_file(broken / "model.safetensors")
    for layer in range(3):
        prefix = f"model.layers.{layer}.mlp.experts."
        gates = [tensors.pop(f"{prefix}{e}.gate_proj.weight") for e in range(TINY_NUM_EXPERTS)]
        ups = [tensors.pop(f"{prefix}{e}.up_proj.weight") for e in range(TINY_NUM_EXPERTS)]
        downs = [tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(TINY_NUM_EXPERTS)]
        tensors[prefix + "gate_up_proj"] = torch.stack([torch.cat(p) for p in zip(gates, ups, strict=True)])
        tensors[prefix + "down_proj"] = torch.stack(downs)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(UnsupportedModel, match="fused"):
        list(iter_weights(broken, read_arch_config(broken), torch.float32, show_progress=False))


def write_moe_gguf(path: Path, *, per_expert: bool = False, gating: int | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    if gating is not None:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 32), np.float32))
    if per_expert:  # before llama.cpp stacked them
        for e in range(4):
            writer.add_tensor(f"blk.0.ffn_gate.{e}.weight", np.zeros((16, 32), np.float32))
    else:
        writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_refusals(tmp_path: Path) -> None:
    assert read_arch_config(write_moe_gguf(tmp_path / "ok.gguf")).architecture == "qwen3_moe"
    with pytest.raises(UnsupportedModel, match="stacked"):
        read_arch_config(write_moe_gguf(tmp_path / "old.gguf", per_expert=True))
    with pytest.raises(UnsupportedModel, match="softmax"):
        read_arch_config(write_moe_gguf(tmp_path / "sigmoid.gguf", gating=2))
