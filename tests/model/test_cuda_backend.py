"""The CUDA backend through the engine, run on a CPU (its kernels under Triton's interpreter) against the torch
reference: decode steps on persistent buffers (model/backends/decode_graphs.py: the sizes captured, the
padding, the buffers' reuse and what falls back to eager steps; on a CPU a "capture" replays the step
itself on the same buffers, the recording into a CUDA graph needs a GPU: scripts/gpu_check.sh measures it
there), and Gemma 3's sliding-window layers on the Triton kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.triton_interpreter import load_cuda_backend, triton_interpreter  # noqa: F401

load_cuda_backend()

from kvserve import engine as engine_module  # noqa: E402
from kvserve.config import BackendConfig  # noqa: E402
from kvserve.model.backends.base import AttentionMetadata, DecoderLayout  # noqa: E402
from kvserve.model.backends.cuda import CudaBackend  # noqa: E402
from kvserve.model.backends.decode_graphs import (  # noqa: E402
    PADDING_SLOT,
    DecodeGraphs,
    StepBuffers,
    bucket_for,
    capture_sizes,
)
from kvserve.offline import LLM  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402
from tests.model.test_backends import arch  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_the_sizes_captured_and_the_size_a_step_is_padded_to() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert [bucket_for(rows, sizes) for rows in (1, 3, 5, 9, 249, 256, 257)] == [1, 4, 8, 16, 256, 256, None]


def test_padding_rows_write_no_kv_and_read_one_key() -> None:
    hidden, cos = torch.randn(3, 8), torch.randn(3, 1, 4)
    buffers = StepBuffers.allocate(8, hidden_size=8, head_dim=4, table_width=5, dtype=torch.float32,
                                   device=torch.device("cpu"), cascade=False, num_rotations=2, num_tables=2)
    table, window_table = buffers.tables
    assert table.slot_mapping.tolist() == [PADDING_SLOT] * 8 and table.seq_lens.tolist() == [1] * 8
    meta = AttentionMetadata(slot_mapping=torch.tensor([40, 17, 3]), num_decode_tokens=3,
                             decode_block_table=torch.tensor([[2, 1], [1, 0], [0, 0]], dtype=torch.int32),
                             decode_seq_lens=torch.tensor([20, 2, 4], dtype=torch.int32))
    # A KV group of its own (Gemma 3's window layers): other slots and tables for the same rows.
    window_meta = AttentionMetadata(slot_mapping=torch.tensor([8, 9, 10]), num_decode_tokens=3,
                                    decode_block_table=torch.tensor([[0, 3], [4, 0], [5, 0]], dtype=torch.int32),
                                    decode_seq_lens=torch.tensor([20, 2, 4], dtype=torch.int32))
    table.slot_mapping.fill_(7)  # what an earlier, wider step left
    table.seq_lens.fill_(30)
    buffers.fill(hidden, [(cos, -cos), (2 * cos, cos)], [meta, window_meta], size=4)
    assert table.slot_mapping[:4].tolist() == [40, 17, 3, PADDING_SLOT]
    assert window_table.slot_mapping[:4].tolist() == [8, 9, 10, PADDING_SLOT]
    assert table.seq_lens[:4].tolist() == [20, 2, 4, 1]
    assert table.block_table[:3, :2].tolist() == [[2, 1], [1, 0], [0, 0]]
    assert window_table.block_table[:3, :2].tolist() == [[0, 3], [4, 0], [5, 0]]
    assert torch.equal(buffers.hidden[:3], hidden) and torch.equal(buffers.rotations[0][1][:3], -cos)
    assert torch.equal(buffers.rotations[1][0][:3], 2 * cos)
    step_meta, _ = buffers.metadata(4)
    assert step_meta.decode_block_table is not None and step_meta.decode_block_table.shape == (4, 5)
    assert step_meta.slot_mapping.data_ptr() == table.slot_mapping.data_ptr()  # views, not copies


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("graphs"), "llama")


Replies = list[tuple[list[int], list[dict[int, float]] | None]]  # per request: tokens, top logprobs


def generate(model: Path, monkeypatch: pytest.MonkeyPatch | None, prompts: list[list[int]],
             params: list[SamplingParams], **options: object) -> tuple[Replies, LLM]:
    """Outputs through an engine on the CUDA backend (``monkeypatch`` given; here on the CPU) or on the torch
    reference (without)."""
    if monkeypatch is not None:
        monkeypatch.setattr(engine_module, "select_backend",
                            lambda device, dtype, arch, want, config, **_: CudaBackend(arch, device, config))
    # 512 keys: two key splits per captured table, the second empty for these prompts (the merge still runs);
    # the default's 32 splits cost Triton's interpreter a program each for nothing more.
    defaults = {"max_num_seqs": 8, "cuda_graph_max_seq_len": 512}
    llm = LLM(str(model), dtype="float32", cpu_kernels=False, **{**defaults, **options})
    return replies(llm, prompts, params), llm


def replies(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Replies:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def assert_same(got: Replies, expected: Replies) -> None:
    """The same tokens and, where asked for, top logprobs within float32 rounding: the tiny model's greedy
    replies repeat one token, its logprobs move with any change to the logits (a KV row written into a live
    slot, a padding row's output read)."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, got_logprobs), (_, expected_logprobs) in zip(got, expected, strict=True):
        assert (got_logprobs is None) == (expected_logprobs is None)
        for got_top, expected_top in zip(got_logprobs or [], expected_logprobs or [], strict=True):
            assert got_top.keys() == expected_top.keys()
            assert all(abs(got_top[t] - expected_top[t]) < 1e-4 for t in got_top)


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(200, 40000, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int, logprobs: int | None = 5) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def test_decode_steps_on_the_buffers_give_the_reference_tokens(tiny_llama, monkeypatch) -> None:
    """Five requests finishing at different steps (decode steps of 5, 4, 3, 2 and 1 rows, padded to 8, 4, 4,
    2 and 1 while the first request's KV is live), one of them longer than the captured table (its steps
    run eagerly): the same tokens as the torch reference, the same buffers every step."""
    prompts, params = random_prompts((3, 9, 17, 30, 5), seed=3), [greedy(n) for n in (6, 12, 20, 9, 15)]
    expected, _ = generate(tiny_llama, None, prompts, params)
    got, llm = generate(tiny_llama, monkeypatch, prompts, params, cuda_graph_max_rows=8,
                        cuda_graph_max_seq_len=32)
    assert_same(got, expected)
    graphs = llm.engine.model.fused_decode
    assert isinstance(graphs, DecodeGraphs) and sorted(graphs.steps) == [1, 2, 4, 8]
    assert graphs.table_width == 32 // 16 and graphs.buffers is not None
    assert graphs.buffers.hidden.shape[0] == 8
    # The steps holding the 30-token prompt past 32 keys ran eagerly; the rest replayed.
    decode_steps = max(p.max_tokens for p in params) - 1  # type: ignore[type-var]
    assert 0 < graphs.num_replays < decode_steps
    buffers = graphs.buffers.hidden.data_ptr()
    assert_same(replies(llm, prompts[1:2], params[1:2]), expected[1:2])
    assert graphs.buffers.hidden.data_ptr() == buffers and sorted(graphs.steps) == [1, 2, 4, 8]


@pytest.mark.heavy  # CI's time: the decode steps on the buffers run in CI; drafts and prefix hits on them here
def test_drafts_and_prefix_hits_on_the_buffers(tiny_llama, monkeypatch) -> None:
    """n-gram drafts (a request's rows: its token and its drafts; past 4 rows a step runs eagerly) for a
    request beside one asking for logprobs (which drafts nothing), then the same prompts again, served from
    the prefix cache."""
    prompts = [p * 2 for p in random_prompts((10, 16), seed=5)]  # something for prompt lookup to find
    params = [greedy(8), greedy(8, logprobs=None)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False}
    expected, _ = generate(tiny_llama, None, prompts, params, speculative_config=spec)
    got, llm = generate(tiny_llama, monkeypatch, prompts, params, speculative_config=spec, cuda_graph_max_rows=4)
    assert_same(got, expected)
    assert_same(replies(llm, prompts, params), expected)
    assert llm.engine.stats().prefix_cache_hits > 0
    graphs = llm.engine.model.fused_decode
    assert isinstance(graphs, DecodeGraphs) and graphs.num_replays > 0 and graphs.sizes == [1, 2, 4]
    assert llm.engine.runner.num_proposed_tokens > 0
    narrow = LLM(str(tiny_llama), dtype="float32", cpu_kernels=False, max_num_seqs=3, cuda_graph_max_seq_len=512)
    assert narrow.engine.model.fused_decode.sizes == [1, 2, 4]  # 3 requests, one row each, at most
    wide = LLM(str(tiny_llama), dtype="float32", cpu_kernels=False, max_num_seqs=5, speculative_config=spec,
               cuda_graph_max_seq_len=512)
    assert wide.engine.model.fused_decode.sizes[-1] == 24  # 5 requests with 3 drafts each: 20 rows


def test_enforce_eager_a_mixture_of_experts_and_untiled_heads_build_no_graphs() -> None:
    cpu = torch.device("cpu")
    built = CudaBackend(arch(16), cpu, BackendConfig())
    layout = DecoderLayout(llama_layers=True, layer_rotations=())
    assert isinstance(built.build_fused_decode([], layout), DecodeGraphs) and "CUDA graphs" in built.description
    for backend, why in ((CudaBackend(arch(16), cpu, BackendConfig(enforce_eager=True)), "--enforce-eager"),
                         (CudaBackend(arch(16, num_experts=8, num_experts_per_token=2), cpu, BackendConfig()),
                          "mixture of experts"),
                         (CudaBackend(arch(80), cpu, BackendConfig()), "head size")):
        assert backend.build_fused_decode([], layout) is None and why in backend.description


@pytest.mark.heavy  # CI runs the Triton kernels' windows in tests/model/test_triton_attention.py
def test_gemma3_window_layers_on_the_triton_kernels_and_the_buffers(tmp_path, monkeypatch) -> None:
    """Prompts longer than the tiny Gemma 3's window of 8, its window layers' freed pages pointing at the null
    page: the kernels apply the window and read none of those pages, in eager steps and in replayed ones
    (each KV group's tables and each rope base's rotation on buffers of their own)."""
    model = make_tiny_model(tmp_path, "gemma3")
    prompts, params = random_prompts((5, 13, 30), seed=7), [greedy(n) for n in (12, 9, 14)]
    expected, _ = generate(model, None, prompts, params)
    got, llm = generate(model, monkeypatch, prompts, params, max_num_batched_tokens=16)  # prompts in chunks
    assert_same(got, expected)
    layout = llm.engine.kv_layout
    assert layout.is_grouped and llm.engine.backend.name == "cuda_triton"
    graphs = llm.engine.model.fused_decode
    assert isinstance(graphs, DecodeGraphs) and graphs.num_replays > 0 and graphs.buffers is not None
    assert len(graphs.buffers.tables) == layout.num_groups and len(graphs.buffers.rotations) == 2
    assert graphs.layer_tables == layout.layer_group and set(graphs.layer_rotations) == {0, 1}


def test_a_failed_capture_leaves_every_step_eager(tiny_llama, monkeypatch, caplog) -> None:
    """A capture that raises (as an unforeseen CUDA error would) is logged; the engine serves eagerly."""
    def failing(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    from kvserve.model.backends import cuda

    monkeypatch.setattr(cuda, "replay_eagerly", failing)
    prompts, params = random_prompts((4, 9), seed=8), [greedy(5), greedy(7)]
    expected, _ = generate(tiny_llama, None, prompts, params)
    got, llm = generate(tiny_llama, monkeypatch, prompts, params)
    assert_same(got, expected)
    graphs = llm.engine.model.fused_decode
    assert isinstance(graphs, DecodeGraphs) and graphs.num_replays == 0 and not graphs.steps
    assert graphs.capture_error == "RuntimeError: operation not permitted when stream is capturing"
    assert "capture failed, decode steps run eagerly" in caplog.text


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qkv_bias_and_qk_norm_families_on_the_buffers(tmp_path, monkeypatch, family) -> None:
    """Qwen2's QKV bias and Qwen3's QK-norm (with a head size unlike hidden / heads) inside the replayed steps."""
    model = make_tiny_model(tmp_path, family)
    prompts, params = random_prompts((6, 11), seed=9), [greedy(6), greedy(4)]
    expected, _ = generate(model, None, prompts, params)
    got, llm = generate(model, monkeypatch, prompts, params)
    assert_same(got, expected)
    graphs = llm.engine.model.fused_decode
    assert isinstance(graphs, DecodeGraphs) and graphs.num_replays > 0


def test_cascade_decode_on_the_buffers(tiny_llama, monkeypatch) -> None:
    """Three requests sharing a 32-token prompt prefix (two full blocks, held once by the prefix cache) before
    tails of their own: replayed decode steps read the shared blocks once for every row, with the torch
    reference's tokens and logprobs."""
    from kvserve.model.backends import triton_attention

    prefix_blocks: list[int] = []  # each launch's count of shared blocks (0: a step without a prefix)
    kernel = triton_attention._prefix_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                prefix_blocks.append(int(args[4][0]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_attention, "_prefix_kernel", Counted())
    shared = random_prompts((32,), seed=10)[0]
    prompts = [shared + tail for tail in random_prompts((3, 7, 1), seed=11)]
    params = [greedy(n) for n in (4, 6, 3)]
    expected, _ = generate(tiny_llama, None, prompts, params, cascade_min_tokens=16)
    got, llm = generate(tiny_llama, monkeypatch, prompts, params, cascade_min_tokens=16)
    assert_same(got, expected)
    graphs = llm.engine.model.fused_decode
    assert isinstance(graphs, DecodeGraphs) and graphs.num_replays > 0
    assert max(prefix_blocks) == 2, "no replayed decode step read the shared prefix"
