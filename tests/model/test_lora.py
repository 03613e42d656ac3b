"""LoRA adapter files: what is refused (with what message), how a fused projection's matrices are laid out and
scaled, and how a step's rows find their adapters. The real-model check against PEFT is tests/e2e/test_lora.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvserve.config import ArchConfig, ModelConfig, lora_module
from kvserve.errors import ConfigError
from kvserve.model.loader import read_arch_config
from kvserve.model.lora import LoRALoadError, StepLoRA, load_adapter
from tests.support.lora_adapters import module_name, write_adapter

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def arch(default_model_path: Path) -> ArchConfig:
    return read_arch_config(default_model_path)


def test_q_and_v_are_laid_out_on_the_fused_projection_with_their_scales(tmp_path, arch) -> None:
    tensors = write_adapter(tmp_path, arch, {(0, "q_proj"): 4, (0, "v_proj"): 2}, lora_alpha=8,
                            alpha_pattern={"v_proj": 4})
    adapter = load_adapter("a", tmp_path, arch, torch.float32, CPU)
    qkv = adapter.layers[0]["qkv"]
    assert set(adapter.layers[0]) == {"qkv"} and all(not layer for layer in adapter.layers[1:])
    assert adapter.rank == 4 and qkv.a.shape == (6, arch.hidden_size)
    assert qkv.bt.shape == (6, arch.q_size + 2 * arch.kv_size)
    q_a, q_b = tensors[f"{module_name(0, 'q_proj')}.lora_A.weight"], tensors[f"{module_name(0, 'q_proj')}.lora_B.weight"]
    v_a, v_b = tensors[f"{module_name(0, 'v_proj')}.lora_A.weight"], tensors[f"{module_name(0, 'v_proj')}.lora_B.weight"]
    torch.testing.assert_close(qkv.a, torch.cat([q_a, v_a]))
    assert qkv.parts.tolist() == [[0, arch.q_size, 0, 4], [arch.q_size + arch.kv_size, arch.q_size + 2 * arch.kv_size, 4, 6]]
    x = torch.randn(3, arch.hidden_size)
    delta = (x @ qkv.a.T) @ qkv.bt
    v_start = arch.q_size + arch.kv_size
    torch.testing.assert_close(delta[:, : arch.q_size], (x @ q_a.T @ q_b.T) * (8 / 4))  # alpha / rank
    torch.testing.assert_close(delta[:, v_start:], (x @ v_a.T @ v_b.T) * (4 / 2))  # the pattern's alpha
    assert not delta[:, arch.q_size:v_start].any()  # k has no update


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path, arch) -> None:
    tensors = write_adapter(tmp_path, arch, {(1, "down_proj"): 4}, lora_alpha=8, use_rslora=True)
    down = load_adapter("a", tmp_path, arch, torch.float32, CPU).layers[1]["down"]
    b = tensors[f"{module_name(1, 'down_proj')}.lora_B.weight"]
    torch.testing.assert_close(down.bt, b.T * (8 / math.sqrt(4)))


@pytest.mark.parametrize(("config", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias 'all'"),
    ({"peft_type": "IA3"}, "only LORA"),
    ({"lora_alpha": 0}, "lora_alpha must be a positive number"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens is set"),
    ({"layer_replication": [[0, 2]]}, "layer_replication is set"),
    ({"init_lora_weights": "pissa_niter_4"}, "changes the base model's weights"),
    ({"alpha_pattern": {"q_proj(": 4}}, "not a regular expression"),
    ({"alpha_pattern": {"q_proj": "four"}}, "not a positive number"),
])
def test_configurations_kvserve_does_not_run_are_refused(tmp_path, arch, config, message) -> None:
    write_adapter(tmp_path, arch, {(0, "q_proj"): 4}, **config)
    with pytest.raises(LoRALoadError, match=message):
        load_adapter("a", tmp_path, arch, torch.float32, CPU)


def test_missing_files_and_foreign_tensors_are_refused_by_name(tmp_path, arch) -> None:
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        load_adapter("a", tmp_path / "nowhere", arch, torch.float32, CPU)
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRALoadError, match="no adapter_model.safetensors"):
        load_adapter("a", tmp_path / "config-only", arch, torch.float32, CPU)

    def refused(tensors: dict[str, torch.Tensor], message: str) -> None:
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        write_adapter(directory, arch, {})
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        with pytest.raises(LoRALoadError, match=message):
            load_adapter("a", directory, arch, torch.float32, CPU)

    a, b = torch.zeros(4, arch.hidden_size), torch.zeros(arch.q_size, 4)
    refused({"base_model.model.model.embed_tokens.lora_embedding_A": a}, "not a LoRA matrix")
    refused({f"{module_name(0, 'q_proj')}.lora_A.weight": a}, "lora_A without its other half")
    refused({f"{module_name(arch.num_layers, 'q_proj')}.lora_A.weight": a,
             f"{module_name(arch.num_layers, 'q_proj')}.lora_B.weight": b}, f"the model has {arch.num_layers}")
    refused({f"{module_name(0, 'q_proj')}.lora_A.weight": torch.zeros(4, 100),
             f"{module_name(0, 'q_proj')}.lora_B.weight": b}, "an adapter of another base model")
    refused({}, "holds no LoRA matrices")
    refused({f"{module_name(0, 'q_proj')}.lora_A.weight": a, f"{module_name(0, 'q_proj')}.lora_A.default.weight": a + 1,
             f"{module_name(0, 'q_proj')}.lora_B.weight": b}, "two lora_A tensors")
    refused({f"{module_name(0, 'q_proj')}.lora_A.weight": torch.zeros(4),
             f"{module_name(0, 'q_proj')}.lora_B.weight": b}, "not a matrix")


def test_a_steps_rows_are_grouped_by_adapter(tmp_path, arch) -> None:
    write_adapter(tmp_path / "one", arch, {(0, "o_proj"): 2}, seed=1)
    write_adapter(tmp_path / "two", arch, {(0, "o_proj"): 3}, seed=2)
    one = load_adapter("one", tmp_path / "one", arch, torch.float32, CPU)
    two = load_adapter("two", tmp_path / "two", arch, torch.float32, CPU)
    assert StepLoRA.for_rows([(None, 0, 3)], 3, CPU) is None
    whole = StepLoRA.for_rows([(one, 0, 2), (one, 2, 3)], 5, CPU)
    assert whole is not None and [(a.name, rows) for a, rows in whole.groups] == [("one", None)]
    # Rows 0-1 base, 2-3 adapter one, 4 adapter two, 5-7 adapter one again (a prefill chunk after the decodes).
    step = StepLoRA.for_rows([(None, 0, 2), (one, 2, 2), (two, 4, 1), (one, 5, 3)], 8, CPU)
    assert step is not None
    assert [(a.name, rows.tolist()) for a, rows in step.groups] == [("one", [2, 3, 5, 6, 7]), ("two", [4])]
    layer = step.layer(0)
    assert layer.targets("o") and not layer.targets("qkv") and not step.layer(1).targets("o")
    x, base = torch.randn(8, arch.q_size), torch.randn(8, arch.hidden_size)
    out = layer.add("o", x, base.clone())
    expected = base.clone()
    for rows, adapter in (([2, 3, 5, 6, 7], one), ([4], two)):
        w = adapter.layers[0]["o"]
        expected[rows] += (x[rows] @ w.a.T) @ w.bt
    torch.testing.assert_close(out, expected)
    assert layer.add("qkv", x, base.clone()).equal(base)


def test_lora_modules_are_spelled_as_vllm_spells_them() -> None:
    assert lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql")
    assert lora_module('{"name": "sql", "path": "/adapters/sql", "base_model_name": "x"}') == ("sql", "/adapters/sql")
    for bad in ("sql", "=/path", "sql=", '{"name": "sql"}', "{not json"):
        with pytest.raises(ConfigError):
            lora_module(bad)
    with pytest.raises(ConfigError, match="names an adapter twice"):
        ModelConfig(lora_modules=("a=/x", "a=/y"))


def test_query_and_key_adapters_are_refused_where_part_of_each_head_rotates(tmp_path, arch) -> None:
    """The loader reorders such a model's Q and K rows (rotary_dim): an adapter's rows there would not follow."""
    from dataclasses import replace

    partial = replace(arch, rotary_dim=arch.head_dim // 2)
    write_adapter(tmp_path / "qk", arch, {(0, "k_proj"): 4})
    with pytest.raises(LoRALoadError, match="rotates part of each head"):
        load_adapter("a", tmp_path / "qk", partial, torch.float32, CPU)
    write_adapter(tmp_path / "v", arch, {(0, "v_proj"): 4})
    assert load_adapter("a", tmp_path / "v", partial, torch.float32, CPU).layers[0]
