"""select_backend: which backend and which kernels each CPU, dtype and head size get; per-layer kernel state."""

from __future__ import annotations

import logging
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import ArchConfig, BackendConfig
from kvserve.errors import ConfigError
from kvserve.model.attention import TorchPagedAttention
from kvserve.model.backends import select
from kvserve.model.backends.base import DecoderLayout, PrefillChunk, StepRows
from kvserve.model.backends.cpu_attention import CpuKernelPagedAttention
from kvserve.model.backends.cpu_kernels import (
    QUANTIZED_FUSED_MAX_ROWS,
    CpuKernelsBackend,
    KernelPlan,
    plan_kernels,
)
from kvserve.model.backends.cpu_ops import DecodeRows, PackedLinear, QuantizedOrDense
from kvserve.model.cpu_kernels import CpuKernels, KernelThreadScope, load_cpu_kernels
from kvserve.model.ops import ModelOps

CPU = torch.device("cpu")
AMX = CpuKernels(gemv_bf16=True, amx=True, avx512=True, quantized_gemv=True, avx2=True)  # Sapphire Rapids on
# AVX512-BF16 without AMX (Cooper Lake, Zen 4)
BF16_ONLY = CpuKernels(gemv_bf16=True, amx=False, avx512=True, quantized_gemv=True, avx2=True)
AVX512_ONLY = CpuKernels(gemv_bf16=False, amx=False, avx512=True, avx2=True)  # Skylake-X (no VNNI)
AVX2_ONLY = CpuKernels(gemv_bf16=False, amx=False, avx512=False, quantized_gemv=True, avx2=True)  # Zen 1-3, Haswell on
NONE = CpuKernels(gemv_bf16=False, amx=False, avx512=False)  # the kernels build, no vector extension they use


def arch(head_dim: int = 64, family: str = "llama", **extra: object) -> ArchConfig:
    return ArchConfig(family, vocab_size=256, hidden_size=9 * head_dim, intermediate_size=256, num_layers=2,
                      num_heads=9, num_kv_heads=3, head_dim=head_dim, max_position_embeddings=4096,
                      **extra)  # type: ignore[arg-type]


def plan(projections, gemv_max_rows, attention, fused=False, vector_carries=False, elementwise=True,
         fallbacks=(), quantized: int | None = 4, by_default: bool | None = None) -> KernelPlan:
    # Mid widths on panels dequantised beside their products wherever the packed family is AVX-512's.
    fused_panels = QUANTIZED_FUSED_MAX_ROWS if quantized is not None and projections in ("avx512", "bf16dot") else 0
    return KernelPlan(projections=projections, gemv_max_rows=gemv_max_rows, elementwise=elementwise,
                      attention=attention, fused_decode=fused, vector_carries_step=vector_carries,
                      quantized_gemv_max_rows=quantized, quantized_fused_max_rows=fused_panels,
                      quantized_by_default=quantized is not None if by_default is None else by_default,
                      fallbacks=tuple(fallbacks))


HEAD_SIZES = (64, 128, 256)  # the many-row kernels and the fused stack take these; 80 stands for any other
NO_PACKED_STACK = "no fused decode stack: no packed projection kernels"
HEAD80_STACK = "no fused decode stack: head size 80 has no many-row kernel"
NO_MANY_ROW_ATTENTION = "torch prefill attention: no AMX, AVX-512 or AVX2 on this CPU"
NO_VECTOR_UNITS = ("torch projections: no AVX2 and FMA on this CPU", NO_MANY_ROW_ATTENTION)
FLOAT32 = ("torch projections and element-wise ops: float32 model (those kernels take bf16)",
           "torch prefill attention: float32 model (the many-row kernels take bf16)",
           "no fused decode stack: float32 model",
           "quantised weights dequantised at load: float32 model (those kernels take bf16)")
NO_VNNI = "quantised decode on dequantised panels: no AVX512-VNNI on this CPU"
QUANTIZED_DEQUANTISED = "quantised weights dequantised at load: no AVX-512 or AVX2 on this CPU"
QUANTIZED_ON_REQUEST = ("quantised weights in their blocks only with --quantization gguf: without AVX-512 a batch "
                        "dequantises them every step")


def head80(*before: str) -> tuple[str, ...]:
    return (*before, "torch prefill attention: head size 80 has no many-row kernel (64, 128, 256)",
            "portable decode attention loop: head size 80 has no vectorised path")


TORCH_OPS_ONLY = plan(None, 0, None, elementwise=False, fallbacks=FLOAT32, quantized=None)
# Per CPU, dtype and head size: each part's kernel, and why each part without one fell back.
EXPECTED = [
    *[(AMX, torch.bfloat16, head, plan("amx", 1, "amx", fused=True)) for head in HEAD_SIZES],
    (AMX, torch.bfloat16, 80, plan("amx", 1, None, fallbacks=(*head80(), HEAD80_STACK))),
    *[(BF16_ONLY, torch.bfloat16, head, plan("bf16dot", 0, "avx512", fused=True, vector_carries=True))
      for head in HEAD_SIZES],
    (BF16_ONLY, torch.bfloat16, 80, plan("bf16dot", 0, None, fallbacks=(*head80(), HEAD80_STACK))),
    *[(AVX512_ONLY, torch.bfloat16, head, plan("avx512", 0, "avx512", fused=True, vector_carries=True,
                                                fallbacks=(NO_VNNI,), quantized=0)) for head in HEAD_SIZES],
    (AVX512_ONLY, torch.bfloat16, 80, plan("avx512", 0, None, fallbacks=(*head80(), HEAD80_STACK, NO_VNNI), quantized=0)),
    *[(AVX2_ONLY, torch.bfloat16, head, plan("avx2", 0, "avx2", fused=True, vector_carries=True, by_default=False,
                                             fallbacks=(QUANTIZED_ON_REQUEST,)))
      for head in HEAD_SIZES],
    (AVX2_ONLY, torch.bfloat16, 80, plan("avx2", 0, None, fallbacks=(*head80(), HEAD80_STACK, QUANTIZED_ON_REQUEST),
                                         by_default=False)),
    *[(NONE, torch.bfloat16, head, plan(None, 0, None, fallbacks=(*NO_VECTOR_UNITS, NO_PACKED_STACK,
                                                                  QUANTIZED_DEQUANTISED), quantized=None))
      for head in HEAD_SIZES],
    (NONE, torch.bfloat16, 80, plan(None, 0, None, fallbacks=(NO_VECTOR_UNITS[0], *head80(), NO_PACKED_STACK,
                                                              QUANTIZED_DEQUANTISED), quantized=None)),
    *[(kernels, torch.float32, head_dim, TORCH_OPS_ONLY) for kernels in (AMX, BF16_ONLY, AVX512_ONLY, AVX2_ONLY, NONE)
      for head_dim in (64, 128)],
]
CPU_NAMES = {AMX: "amx", BF16_ONLY: "bf16", AVX512_ONLY: "avx512", AVX2_ONLY: "avx2", NONE: "none"}
IDS = [f"{CPU_NAMES[kernels]}-{str(dtype)[6:]}-head{head}" for kernels, dtype, head, _ in EXPECTED]


@pytest.mark.parametrize(("kernels", "dtype", "head_dim", "expected"), EXPECTED, ids=IDS)
def test_the_plan_is_the_kernel_choice_of_each_cpu_dtype_and_head_size(kernels, dtype, head_dim, expected) -> None:
    assert plan_kernels(kernels, dtype, arch(head_dim)) == expected


@pytest.mark.parametrize("layout", [{"qkv_bias": True}, {"qk_norm": True}], ids=["qkv-bias", "qk-norm"])
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_the_fused_decode_stack_takes_qkv_bias_and_qk_norm(layout, head_dim) -> None:
    assert plan_kernels(AMX, torch.bfloat16, arch(head_dim, **layout)) == plan("amx", 1, "amx", fused=True)


def test_the_fused_decode_stack_refuses_a_mixture_of_experts() -> None:
    got = plan_kernels(AMX, torch.bfloat16, arch(64, num_experts=8, num_experts_per_token=2))
    assert (got.projections, got.attention, got.fused_decode) == ("amx", "amx", False)
    assert got.fallbacks == ("no fused decode stack: a mixture of experts (its routing runs on the host)",)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_a_head_size_without_kernels_falls_back_and_says_why(head_dim) -> None:
    """Qwen2.5-Coder-1.5B's layout (12 query heads over 2 KV heads, QKV bias) at a head size the many-row
    kernels were not written for: prefill attention and the fused stack fall back, each with its reason,
    and the description (the start-up log line) carries them."""
    shape = ArchConfig("qwen2", vocab_size=256, hidden_size=12 * head_dim, intermediate_size=256, num_layers=2,
                       num_heads=12, num_kv_heads=2, head_dim=head_dim, max_position_embeddings=4096,
                       qkv_bias=True)
    got = plan_kernels(AMX, torch.bfloat16, shape)
    assert (got.projections, got.attention, got.fused_decode) == ("amx", None, False)
    assert got.fallbacks == (
        f"torch prefill attention: head size {head_dim} has no many-row kernel (64, 128, 256)",
        f"portable decode attention loop: head size {head_dim} has no vectorised path",
        f"no fused decode stack: head size {head_dim} has no many-row kernel",
    )
    assert got.description == ("amx projections, bf16 gemv up to 1 row, decode-kernel attention, quantised weights "
                               "packed (int8 dot products up to 4 rows); fell back: " + "; ".join(got.fallbacks))
    assert plan_kernels(AMX, torch.bfloat16, arch(128)).description == (
        "amx projections, bf16 gemv up to 1 row, amx attention, fused decode stack, quantised weights packed "
        "(int8 dot products up to 4 rows)")


def test_cuda_takes_the_triton_backend_where_triton_imports(monkeypatch, caplog) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(select, "load_cpu_kernels", lambda: pytest.fail("no C++ kernels for a GPU"))
    with caplog.at_level(logging.INFO, logger=select.__name__):
        backend = select.select_backend(torch.device("cuda"), torch.bfloat16, arch(), True, BackendConfig())
    assert backend.name == "cuda_triton"
    assert [r.getMessage() for r in caplog.records] == [f"backend: {backend.description}"]


def test_the_torch_reference_where_kernels_are_not_wanted_or_not_there(monkeypatch, caplog) -> None:
    built: list[bool] = []
    monkeypatch.setattr(select, "load_cpu_kernels", lambda: built.append(True) or AMX)
    monkeypatch.setitem(sys.modules, "triton", None)  # a GPU without Triton: import triton raises ImportError
    monkeypatch.delitem(sys.modules, "kvserve.model.backends.cuda", raising=False)
    monkeypatch.delitem(sys.modules, "kvserve.model.backends.triton_attention", raising=False)
    for device, want, why in ((CPU, False, "not wanted"), (torch.device("cuda"), True, "none for cuda")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=select.__name__):
            backend = select.select_backend(device, torch.bfloat16, arch(), want, BackendConfig())
        messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert messages == [f"backend: {backend.description}; no C++ kernels: {why}"]
        assert backend.name == "torch_ref" and backend.argmax is None and backend.ops == ModelOps()
        assert type(backend.make_attention(0)) is TorchPagedAttention
        assert isinstance(backend.step_scope(), nullcontext)
        assert backend.build_fused_decode([], DecoderLayout(llama_layers=True, layer_rotations=())) is None
    assert not built, "the kernels are not even built where they are not wanted"
    monkeypatch.setattr(select, "load_cpu_kernels", lambda: None)  # they did not build
    assert select.select_backend(CPU, torch.bfloat16, arch(), True, BackendConfig()).name == "torch_ref"


needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ CPU kernels did not build here")


@needs_kernels
@pytest.mark.parametrize(("kernels", "dtype", "head_dim", "expected"), EXPECTED, ids=IDS)
def test_select_backend_builds_what_its_plan_says(monkeypatch, caplog, kernels, dtype, head_dim, expected) -> None:
    """The backend's objects follow the plan (the kernels' op handles exist on any CPU once they load)."""
    monkeypatch.setattr(select, "load_cpu_kernels", lambda: kernels)
    with caplog.at_level(logging.INFO, logger=select.__name__):
        backend = select.select_backend(CPU, dtype, arch(head_dim), True, BackendConfig(decode_split_size=64))
    assert backend.name == "cpu_kernels" and backend.plan == expected
    assert [r.getMessage() for r in caplog.records] == [f"backend: {backend.description}"]
    assert backend.argmax is torch.ops.kvserve.argmax_rows  # in any dtype
    ops = backend.ops
    linear, gate_up = ops.linear, ops.fused_gate_up_silu
    if expected.quantized_gemv_max_rows is not None:  # the quantised kernels in front of the dense plan
        assert isinstance(linear, QuantizedOrDense) and isinstance(gate_up, QuantizedOrDense)
        linear, gate_up = linear.dense, gate_up.dense
    if expected.gemv_max_rows:
        assert isinstance(linear, DecodeRows) and linear.max_rows == expected.gemv_max_rows
        linear = linear.wider
    if expected.projections:
        assert isinstance(linear, PackedLinear) and linear.kernels.name == expected.projections
        assert gate_up.min_rows == expected.gemv_max_rows + 1  # the GEMV's rows stay on it
    elif expected.quantized_gemv_max_rows is None:
        assert linear is F.linear and gate_up is None
    else:
        assert linear is F.linear
    assert (ops.add_rms_norm is torch.ops.kvserve.add_rms_norm) == expected.elementwise
    attention = backend.make_attention(0)
    assert type(attention) is CpuKernelPagedAttention and attention.split_size == 64
    assert attention.many_rows == expected.attention
    # Before a fused stack is built, only the plain-vector kernels carry a step's heavy ops.
    assert isinstance(backend.step_scope(), KernelThreadScope) == expected.vector_carries_step
    assert backend.description.startswith(f"cpu_kernels ({expected.projections or 'torch'} projections")
    assert (", fused decode stack" in backend.description) == expected.fused_decode
    assert all(reason in backend.description for reason in expected.fallbacks)


def test_backend_config_refuses_what_the_kernels_cannot_take() -> None:
    for bad in ({"cascade_min_tokens": 0}, {"decode_split_size": 0}, {"shared_prefill_min_tokens": -1},
                {"cascade_min_tokens": True}):
        with pytest.raises(ConfigError):
            BackendConfig(**bad)


@pytest.mark.skipif(load_cpu_kernels() is None or not load_cpu_kernels().amx, reason="no AMX on this CPU")
def test_each_layer_keeps_its_own_packed_prefix() -> None:
    """Two layers' attention objects on the same step: each packs its own cache's shared prefix and keeps
    it; a later step on the same blocks finds it kept; a step that rewrites a prefix block repacks it."""
    torch.manual_seed(1)
    backend = select.select_backend(CPU, torch.bfloat16, arch(), True, BackendConfig(cascade_min_tokens=16))
    block_size, shared, batch = 16, [0, 1, 2], 4
    tables = [shared + [3 + i] for i in range(batch)]
    rows = StepRows(block_size, torch.tensor([(3 + i) * block_size + 2 for i in range(batch)]),
                    decode_block_ids=tables, decode_kv_lens=[3 * block_size + 3] * batch,
                    written_block_ids=[3 + i for i in range(batch)])
    caches = [torch.randn(2, 8, block_size, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    layers = [backend.make_attention(i) for i in range(2)]
    q = torch.randn(batch, 9, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, batch, 3, 64, dtype=torch.bfloat16)

    def step(written: list[int]) -> list[torch.Tensor]:
        meta = backend.build_metadata(StepRows(rows.block_size, rows.slot_mapping, rows.decode_block_ids,
                                               rows.decode_kv_lens, written_block_ids=written))
        assert meta.decode_prefix_key is not None
        return [layer.forward(q, k, v, cache, meta) for layer, cache in zip(layers, caches, strict=True)]

    first = step(rows.written_block_ids)
    packed = [layer._packed_prefix[1] for layer in layers]
    for cache, kept in zip(caches, packed, strict=True):
        assert torch.equal(kept, torch.ops.kvserve.pack_kv_amx(cache[0], cache[1], torch.tensor(shared,
                                                               dtype=torch.int32), 3 * block_size))
    assert not torch.equal(packed[0], packed[1])
    assert [torch.equal(a, b) for a, b in zip(step(rows.written_block_ids), first, strict=True)] == [True, True]
    assert all(layer._packed_prefix[1] is kept for layer, kept in zip(layers, packed, strict=True))
    caches[1][:, 1] = torch.randn_like(caches[1][:, 1])  # a tier load rewrites a prefix block
    step([1])
    assert layers[0]._packed_prefix[1] is not packed[0] and layers[1]._packed_prefix[1] is not packed[1]
    assert torch.equal(layers[0]._packed_prefix[1], packed[0])
    assert not torch.equal(layers[1]._packed_prefix[1], packed[1])


@needs_kernels
def test_the_cpu_metadata_adds_only_what_its_kernels_read() -> None:
    """The common layout on both backends; the decode mask only on the reference; the runs and packed
    prefix keys only where a many-row kernel takes them."""
    chunk_blocks = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18 + i] for i in range(2)]
    rows = StepRows(16, torch.arange(2 * 300), prefills=[PrefillChunk(300 * i, 300, 300 + 1, chunk_blocks[i])
                                                          for i in range(2)], written_block_ids=[18, 19])
    reference = select.select_backend(CPU, torch.bfloat16, arch(), False, BackendConfig())
    kernels = load_cpu_kernels()
    for offered, runs, packs in ((NONE, False, False), (AVX512_ONLY, True, False), (AMX, True, True)):
        if offered.amx and not kernels.amx:
            continue
        backend = CpuKernelsBackend(plan_kernels(offered, torch.bfloat16, arch()), arch(), CPU, BackendConfig())
        meta = backend.build_metadata(rows)
        assert [(s.q_start, s.q_len, s.kv_len) for s in meta.prefills] == [
            (s.q_start, s.q_len, s.kv_len) for s in reference.build_metadata(rows).prefills]
        assert (meta.prefill_runs is not None) == runs
        # 18 shared full blocks of 16 keys: 288, a whole number of 32-key steps.
        assert meta.prefill_prefix_keys == (288 if packs else 0)
        assert (meta.prefill_prefix_key is not None) == packs


def test_the_runner_tells_the_backend_every_block_a_step_writes() -> None:
    """Tier loads rewrite blocks too, even in a step with no forward; the backend hears of them."""
    from types import SimpleNamespace

    from kvserve.batch import ScheduledRequest, SchedulerOutput
    from kvserve.runner.kv_transfer import block_nbytes
    from kvserve.runner.model_runner import ModelRunner
    from kvserve.runner.sampler import Sampler

    class Recording:
        def __init__(self) -> None:
            self.written: list[list[int]] = []

        def build_metadata(self, rows: StepRows) -> None:
            self.written.append(rows.written_block_ids)

    def no_forward(*args: object, **kwargs: object) -> None:
        raise AssertionError("a step without tokens runs no forward")

    backend = Recording()
    model = SimpleNamespace(device=CPU, thread_scope=nullcontext(), forward=no_forward)
    kv_caches = [torch.zeros(2, 4, 4, 1, 2)]
    runner = ModelRunner(model, backend, kv_caches, 4, Sampler(8))  # type: ignore[arg-type]
    runner.execute(SchedulerOutput(kv_offloads=[(2, b"hash")]))  # a copy out writes nothing
    runner.execute(SchedulerOutput(kv_loads=[(1, bytes(block_nbytes(kv_caches)))]))
    assert backend.written == [[1]]
    with pytest.raises(AssertionError, match="no forward"):  # this one has tokens: the forward runs
        runner.execute(SchedulerOutput(scheduled=[ScheduledRequest("r", [3, 4], 3, [0, 3], sample=True)]))
    assert backend.written == [[1], [0, 3]]


def test_a_step_with_drafts_counts_its_decode_requests_and_sets_their_activation_level() -> None:
    """One request's last token and four drafts: five decode rows of one request. The backend gives every
    row the quantised kernels' one int8 level, as that request's plain decode step has."""
    from kvserve.batch import ScheduledRequest, SchedulerOutput
    from kvserve.runner.input_batch import build_inputs

    out = SchedulerOutput(scheduled=[ScheduledRequest("r", [3], 6, [0, 1, 2], sample=True, draft_token_ids=[4, 5, 6, 7])])
    rows = build_inputs(out, 4, CPU).rows
    assert rows.num_decode_rows == 5 and rows.num_decode_requests == 1
    assert StepRows(4, torch.arange(3), decode_block_ids=[[0]] * 3, decode_kv_lens=[1, 2, 3]).num_decode_requests == 3
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.quantized_interleave_rows:
        pytest.skip("no interleaved quantised kernels on this CPU")
    backend = select.select_backend(CPU, torch.bfloat16, arch(), True, BackendConfig())
    levels = backend._activation_levels
    assert levels is not None
    backend.build_metadata(rows)
    assert levels.one_level_rows == 5
    backend.build_metadata(StepRows(4, torch.arange(6), decode_block_ids=[[0]] * 6, decode_kv_lens=[1] * 6))
    # Six requests' plain decode step: one level too, except on AMX (its tiles take them past the few rows).
    assert levels.one_level_rows == (6 if levels.every_decode_step else levels.few_rows)


def test_one_requests_rows_are_not_split_at_a_shared_prefix() -> None:
    """A request's drafts ride as rows with its own block table: they share its whole context, but their
    attention stays unsplit, as its plain one-row decode step's is. Two requests' rows split as before."""
    from kvserve.model.backends.layout import split_decodes

    table = list(range(20))
    one = StepRows(16, torch.arange(5), decode_block_ids=[table] * 5, decode_kv_lens=[300 + i for i in range(5)],
                   num_decode_requests=1)
    split = split_decodes(one, min_shared_tokens=16)
    assert split is not None and split.shared_block_ids == []
    other = list(range(18)) + [40, 41]
    two = StepRows(16, torch.arange(6), decode_block_ids=[table] * 5 + [other],
                   decode_kv_lens=[300 + i for i in range(5)] + [310], num_decode_requests=2)
    split = split_decodes(two, min_shared_tokens=16)
    assert split is not None and split.shared_block_ids == list(range(18))
