"""Quantised weights run in their GGUF blocks against the same file dequantised to bf16, and against llama.cpp.

    python benchmarks/quantized.py [--models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
        [--threads 2] [--prompt-len 512] [--gen-len 128] [--llama-bench /path/to/llama-bench] [--json out.json]
        [--widths 1,2,4,8,16,32,64] [--one-row-read]

For every model (pulled with `kvserve models pull NAME`), one process measures in turn, on the same GGUF
and thread count:

- **kvserve, quantised** (``--quantization gguf``, the default on CPUs with AVX-512), **kvserve, quantised with
  int8 activations** (``--quantized-activations int8``; where the build has the interleaved kernels) and
  **kvserve, bf16** (``--quantization none``): single-stream prefill tokens/s (a prompt of ``--prompt-len`` random tokens, to its first token)
  and decode tokens/s (the next ``--gen-len`` tokens), the best of ``--repeats`` runs; and the weights'
  memory: the bytes the model holds them in plus the copies the kernels packed.
- **llama.cpp** when ``--llama-bench`` names its binary (../shared/PEERS.md builds it): ``llama-bench -p
  PROMPT -n GEN -t THREADS``, which reads the file as it is.
- **The machine's streaming read** before and after each model's runs (a sum over 1 GiB on the same
  threads): what single-stream decode, which reads every weight once a token, can reach at best. On a
  shared VM it moves by tens of percent from minute to minute; each engine's decode is printed beside it as
  the file's bytes read per second.

With ``--widths``, instead: every decoder layer's quantised projections of each model at those numbers of
input rows, side by side and alternating, through each path: on the rows held planar, few-row (int8
activations, VNNI dot products on each row's blocks), fused (each worker takes a panel of 32 weight rows and
multiplies every input row against it while it is in cache: the weights' integers on VDPBF16PS where the CPU
has AVX512-BF16, else the panel dequantised into the packed layout) and slabs (~2 MB of rows dequantised,
then the CPU's bf16 projection kernel over them); where the build has them, on the same weights held
interleaved sixteen rows at a time, the int8 dot products with rows in the lanes (int16 activations past the
few rows, as a prompt chunk's by default; one int8 level per 16 values at every width, as a decode step's by
default; and int8 ones, one level per 32 values, as ``--quantized-activations int8`` takes them at every
width) and the slabs dequantised from that layout: where the plan's limits
(QUANTIZED_GEMV_MAX_ROWS, QUANTIZED_FUSED_MAX_ROWS, QUANTIZED_INTERLEAVED_MAX_ROWS) should sit on this CPU.

With ``--one-row-read``, instead: one row's pass over every layer's projections as the model holds them
(streamed from memory) and over one projection again and again (in cache), in GB/s of the weights' bytes, at
one and two threads, beside the streaming read: whether single-stream decode is bound by the memory or by
the kernel's own arithmetic.

Ratios are printed per model; the machines are shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from cpu_kernels import seconds_per_call  # benchmarks/cpu_kernels.py
from models import _prompts, bench_llama_cpp  # benchmarks/models.py

from kvserve import LLM, SamplingParams
from kvserve.model.backends.cpu_kernels import QUANTIZED_GEMV_MAX_ROWS
from kvserve.model.cpu_kernels import KernelThreadScope, load_cpu_kernels
from kvserve.model.loader import read_arch_config, resolve_model_path
from kvserve.model.quantized import QuantizedWeight

NUM_KV_BLOCKS = 96


@dataclass
class Row:
    engine: str
    model: str
    prefill_tok_s: float
    decode_tok_s: float
    weight_mib: float | None  # the weights' memory, kernel copies included; None where not measured
    file_mib: float


def bench_kvserve(name: str, quantization: str, prompt: list[int], gen_len: int, repeats: int,
                  activations: str = "int16") -> Row:
    llm = LLM(model=name, quantization=quantization, enable_prefix_caching=False, max_num_batched_tokens=4096,
              max_num_seqs=1, num_kv_blocks=NUM_KV_BLOCKS, quantized_activations=activations)
    weight_mib = (llm.engine.model.weight_nbytes() + llm.engine.backend.packed_weight_nbytes()) / 2**20
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt[:32]}], SamplingParams(max_tokens=4))  # warm-up
    prefill = decode = 0.0
    for _ in range(repeats):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        m = out.metrics
        prefill = max(prefill, len(prompt) / (m.first_token_time - m.arrival_time))
        decode = max(decode, (gen_len - 1) / (m.finished_time - m.first_token_time))
    file_mib = resolve_model_path(name).stat().st_size / 2**20
    del llm
    gc.collect()
    engine = "kvserve-bf16" if quantization == "none" else "kvserve-gguf" + ("-int8" if activations == "int8" else "")
    return Row(engine, name, prefill, decode, weight_mib, file_mib)


def streaming_read_gb_s(threads: int, repeats: int = 5) -> float:
    """GB/s of the fastest of ``repeats`` sums over 1 GiB on ``threads`` threads: the memory's streaming read."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    data = torch.ones(2**27, dtype=torch.int64)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * data.element_size() / (time.perf_counter() - t0) / 1e9)
    torch.set_num_threads(before)
    return best


def quantized_projections(llm: LLM, name: str) -> list[QuantizedWeight]:
    """Every decoder layer's projections that run quantised, in the model's order."""
    weights = [w for layer in llm.engine.model.layers
               for w in (layer.qkv_weight, layer.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight)
               if isinstance(w, QuantizedWeight)]
    if not weights:
        raise SystemExit(f"{name}: no projection runs quantised on this CPU (see the backend line at start-up)")
    return weights


def bench_widths(name: str, widths: list[int], rounds: int = 3) -> list[dict]:
    """Seconds per pass over every layer's quantised projections at each width through each path (planar:
    few-row int8 dot products, fused panels, slabs; interleaved where the build has it: its int8 dot products
    and its slabs), alternating; speed-ups against the planar slabs are medians over ``rounds`` alternating
    measurements."""
    llm = LLM(model=name, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=1)
    loaded = quantized_projections(llm, name)
    layouts = {"planar": [QuantizedWeight(tuple(s.planar(w.cols) for s in w.segments), w.cols) for w in loaded]}
    if all(w.interleaved for w in loaded):
        layouts["interleaved"] = loaded
    paths = {path: spec for path, spec in PATHS.items() if spec[0] in layouts}
    results = []
    with KernelThreadScope():  # as in an engine step: the kernels' threads, torch's ops on this thread
        for rows in widths:
            inputs = {w.cols: torch.randn(rows, w.cols, dtype=torch.bfloat16) for w in loaded}

            def run(layout: str, gemv_rows: int, fused_rows: int, int8: bool,
                    inputs: dict[int, torch.Tensor] = inputs) -> float:
                def call() -> None:
                    for w in layouts[layout]:
                        torch.ops.kvserve.quant_linear(inputs[w.cols], w.data, w.types, w.cols, None, gemv_rows,
                                                       fused_rows, int8)
                return seconds_per_call(call, min_time=0.3)

            times: dict[str, list[float]] = {path: [] for path in paths}
            for _ in range(rounds):
                for path, (layout, gemv_rows, fused_rows, int8) in paths.items():
                    times[path].append(run(layout, gemv_rows(rows), fused_rows(rows), int8))
            r = {"model": name, "rows": rows}
            for path in paths:
                r[f"{path}_ms"] = 1e3 * statistics.median(times[path])
                r[f"{path}_speedup_over_slabs"] = statistics.median(
                    slab / t for slab, t in zip(times["slabs"], times[path], strict=True))
            results.append(r)
            print(f"{name:20s} {rows:3d} rows  " + "  ".join(
                f"{path} {r[f'{path}_ms']:7.2f} ms ({r[f'{path}_speedup_over_slabs']:.2f}x)" for path in paths),
                flush=True)
    del llm
    gc.collect()
    return results


def bench_one_row_read(name: str, rounds: int = 3) -> list[dict]:
    """GB/s of one row's pass over the weights as the model holds them, at one and two kernel threads: every
    layer's projections (streamed from memory), and the first layer's output projection again and again
    (in cache), beside the streaming read of the same thread count. A kernel that reads from cache no faster
    than from memory is bound by the memory; one whose streamed rate falls well below both is not overlapping
    its arithmetic with its reads."""
    llm = LLM(model=name, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=1)
    streamed = quantized_projections(llm, name)
    cached = [llm.engine.model.layers[0].o_weight]
    inputs = {w.cols: torch.randn(1, w.cols, dtype=torch.bfloat16) for w in streamed}

    def gb_s(weights: list[QuantizedWeight]) -> float:
        def call() -> None:
            for w in weights:
                torch.ops.kvserve.quant_linear(inputs[w.cols], w.data, w.types, w.cols, None, QUANTIZED_GEMV_MAX_ROWS,
                                               0, False)
        return sum(t.numel() * t.element_size() for w in weights for t in w.data) / seconds_per_call(call, 0.3) / 1e9

    results = []
    for threads in (1, 2):
        rates: dict[str, list[float]] = {"streamed": [], "cached": [], "streaming_read": []}
        for _ in range(rounds):
            rates["streaming_read"].append(streaming_read_gb_s(threads))
            with KernelThreadScope():
                torch.ops.kvserve.set_kernel_threads(threads)
                rates["streamed"].append(gb_s(streamed))
                rates["cached"].append(gb_s(cached))
        r = {"model": name, "threads": threads, **{f"{k}_gb_s": statistics.median(v) for k, v in rates.items()}}
        results.append(r)
        print(f"{name:20s} one row, {threads} thread(s): every layer's projections {r['streamed_gb_s']:5.1f} GB/s, "
              f"one in cache {r['cached_gb_s']:5.1f} GB/s, streaming read {r['streaming_read_gb_s']:5.1f} GB/s",
              flush=True)
    del llm
    gc.collect()
    return results


# The quantised paths, as the weights' layout and quant_linear's (gemv_max_rows, fused_max_rows,
# int8_activations) given the width w: on planar weights (w, 0) takes the int8 dot products, (0, w) the
# panels multiplied by the worker that reads them, (0, 0) the slabs; on interleaved weights
# (QUANTIZED_GEMV_MAX_ROWS, w) their int8 dot products (with the activations' residuals past the few rows, as
# the plan runs a prompt chunk's by default), (w, w) the same at one int8 level per 16 values (as a decode step
# takes them by default), the same with int8 activations (one level per 32 values, as
# --quantized-activations int8 runs them), (0, 0) their slabs.
PATHS: dict[str, tuple[str, Callable[[int], int], Callable[[int], int], bool]] = {
    "few_row": ("planar", lambda w: w, lambda w: 0, False),
    "fused": ("planar", lambda w: 0, lambda w: w, False),
    "slabs": ("planar", lambda w: 0, lambda w: 0, False),
    "interleaved": ("interleaved", lambda w: QUANTIZED_GEMV_MAX_ROWS, lambda w: w, False),
    "interleaved_one_level": ("interleaved", lambda w: w, lambda w: w, False),
    "interleaved_int8": ("interleaved", lambda w: QUANTIZED_GEMV_MAX_ROWS, lambda w: w, True),
    "interleaved_slabs": ("interleaved", lambda w: 0, lambda w: 0, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench binary")
    parser.add_argument("--json", default=None, help="write the figures here too")
    parser.add_argument("--widths", default=None,
                        help="comma-separated row counts: compare the few-row and many-row quantised paths instead")
    parser.add_argument("--one-row-read", action="store_true",
                        help="instead: one row's read rate over the weights, streamed and in cache, at 1 and 2 threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.widths or args.one_row_read:
        names = args.models.split(",")
        if args.widths:
            widths = [int(w) for w in args.widths.split(",")]
            sweep = [r for name in names for r in bench_widths(name, widths)]
        else:
            sweep = [r for name in names for r in bench_one_row_read(name)]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(sweep, f, indent=1)
        return

    results: list[Row] = []
    streams: dict[str, list[float]] = {}
    for name in args.models.split(","):
        path = resolve_model_path(name)
        prompt = _prompts(read_arch_config(path).vocab_size, 1, args.prompt_len, seed=1)[0]
        streams[name] = [streaming_read_gb_s(args.threads)]
        rows = [bench_kvserve(name, "gguf", prompt, args.gen_len, args.repeats)]
        kernels = load_cpu_kernels()
        if kernels is not None and kernels.quantized_interleave_rows:
            rows.append(bench_kvserve(name, "gguf", prompt, args.gen_len, args.repeats, activations="int8"))
        rows.append(bench_kvserve(name, "none", prompt, args.gen_len, args.repeats))
        if args.llama_bench:
            speed = bench_llama_cpp(args.llama_bench, name, args.threads, args.prompt_len, args.gen_len)
            rows.append(Row("llama.cpp", name, speed.prefill_tok_s, speed.decode_tok_s, None,
                            path.stat().st_size / 2**20))
        streams[name].append(streaming_read_gb_s(args.threads))
        for row in rows:
            memory = f"weights {row.weight_mib:7.1f} MiB (file {row.file_mib:.1f})" if row.weight_mib else ""
            print(f"{row.model:20s} {row.engine:17s} prefill {row.prefill_tok_s:8.1f} tok/s  decode "
                  f"{row.decode_tok_s:7.1f} tok/s ({row.file_mib * 2**20 * row.decode_tok_s / 1e9:4.1f} GB/s of "
                  f"the file)  {memory}", flush=True)
        print(f"{'':20s} streaming read, before and after: " + " and ".join(f"{g:.1f}" for g in streams[name])
              + " GB/s", flush=True)
        for quantized in [r for r in rows if r.engine.startswith("kvserve-gguf")]:
            for row in [r for r in rows if not r.engine.startswith("kvserve-gguf")]:
                print(f"{'':20s} {quantized.engine} / {row.engine}: prefill "
                      f"{quantized.prefill_tok_s / row.prefill_tok_s:.2f}x, "
                      f"decode {quantized.decode_tok_s / row.decode_tok_s:.2f}x", flush=True)
        results += rows
        time.sleep(1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in results], "streaming_read_gb_s": streams}, f, indent=1)


if __name__ == "__main__":
    main()
