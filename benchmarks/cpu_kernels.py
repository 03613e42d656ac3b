"""The C++ CPU kernels against the torch paths they replace, side by side in one run.

    python benchmarks/cpu_kernels.py [--threads 2] [--output results.json]

- Projections: SmolLM2-135M's 30 layers (q/k/v, o, gate/up, down) and its 49,152-row LM head, at 1-32
  activation rows, bf16: torch's linear, the AVX512-BF16 GEMV and the AMX tile matmul (weights packed
  once). Reported as GB/s of weights read: decode is bound by that read.
- Projections without AMX, at 1-1,024 rows (SmolLM2-135M's 30 layers and four of Qwen2.5-Coder-1.5B's), in
  GFLOP/s: torch's bf16 linear, the BF16 GEMV, the widening AVX-512 kernel (fp32 FMAs on bf16 weights
  packed once), on CPUs with AVX512-BF16 the VDPBF16PS kernel on the same packing, and the widening AVX2
  kernel (the only one on CPUs without AVX-512); torch's fp32 linear on fp32 copies of the weights for
  scale. The plan (backends/cpu_kernels.py) follows the fastest.
- Decode attention: one query per sequence against 512-2,000 cached keys in a paged bf16 cache, in each
  head layout of ``ATTENTION_LAYOUTS`` (SmolLM2's 9 query heads over 3 KV heads at head_dim 64;
  Qwen2.5-Coder-1.5B's 12 over 2 at 128; Gemma 3 270M's 4 over 1 at 256). The torch path gathers each
  sequence's blocks and calls scaled_dot_product_attention; the kernel reads the blocks in place.
- Many-row attention on AMX tiles (or, without AMX, the AVX-512 kernel of the same contract; without AVX-512,
  the AVX2 one): all prefill chunks of a step in one call (the agentic shape: ten
  100-token turns on ~1,570 cached tokens; one cold 1,024-token prompt), and the shared-prefix half of
  cascade decode (16 decodes against a 1,568-token prefix), also with the prefix's keys pre-packed as
  cascade decode keeps them across steps; in the same head layouts. The torch path is the one it replaces:
  per chunk, gather the blocks and call scaled_dot_product_attention (a flash-attention call for the
  prefix).
- Add + RMSNorm, SiLU-and-multiply and the rotary embedding at one token: the torch ops they replace are
  dispatch-bound there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.model.cpu_kernels import CpuKernels, load_cpu_kernels
from kvserve.model.layers import RotaryEmbedding, apply_rotary
from kvserve.model.ops import torch_add_rms_norm, torch_silu_mul

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (query heads, KV heads, head size) of the attention cases: SmolLM2-135M, Qwen2.5-Coder-1.5B, Gemma 3 270M.
ATTENTION_LAYOUTS = {"smollm2": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128), "gemma3-270m": (4, 1, 256)}


def seconds_per_call(fn: Callable[[], object], min_time: float = 0.5) -> float:
    fn()
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time:
        fn()
        calls += 1
    return elapsed / calls


def bench_gemv(rows_list: list[int], amx: bool) -> list[dict]:
    bf16 = torch.bfloat16
    # fused q/k/v, o, fused gate/up, down: [out_features, in_features]
    shapes = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
              (HIDDEN, INTERMEDIATE)]
    weights = [torch.randn(n, k, dtype=bf16) for _ in range(LAYERS) for n, k in shapes]
    nbytes = sum(w.numel() * 2 for w in weights)
    lm_head = torch.randn(VOCAB, HIDDEN, dtype=bf16)
    packed = {w.data_ptr(): torch.ops.kvserve.amx_pack(w) for w in weights} if amx else {}

    def amx_linear(x: torch.Tensor, w: torch.Tensor, bias: None) -> torch.Tensor:
        return torch.ops.kvserve.amx_linear(x, packed[w.data_ptr()], bias)

    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, dtype=bf16) for k in (HIDDEN, INTERMEDIATE)}

        def layers(matmul: Callable) -> Callable[[], None]:
            return lambda: [matmul(inputs[w.shape[1]], w, None) for w in weights]  # noqa: B023

        t_torch = seconds_per_call(layers(F.linear))
        t_kernel = seconds_per_call(layers(torch.ops.kvserve.gemv_bf16))
        t_amx = seconds_per_call(layers(amx_linear)) if amx and rows <= 32 else float("nan")
        x = inputs[HIDDEN]
        h_torch = seconds_per_call(lambda: F.linear(x, lm_head))  # noqa: B023
        h_kernel = seconds_per_call(lambda: torch.ops.kvserve.gemv_bf16(x, lm_head, None))  # noqa: B023
        results.append({
            "rows": rows,
            "layers_torch_gbps": nbytes / t_torch / 1e9, "layers_kernel_gbps": nbytes / t_kernel / 1e9,
            "layers_speedup": t_torch / t_kernel, "layers_amx_gbps": nbytes / t_amx / 1e9,
            "layers_amx_speedup": t_torch / t_amx,
            "lm_head_torch_ms": h_torch * 1e3, "lm_head_kernel_ms": h_kernel * 1e3, "lm_head_speedup": h_torch / h_kernel,
        })
    return results


# Projection weights [out_features, in_features] per layer (fused q/k/v, o, fused gate/up, down) and the layers
# timed, of the packed-projection cases: SmolLM2-135M whole; four of Qwen2.5-Coder-1.5B's 28 layers.
PROJECTION_MODELS = {
    "smollm2": ([(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
                 (HIDDEN, INTERMEDIATE)], LAYERS),
    "qwen2.5-1.5b": ([(1536 + 2 * 256, 1536), (1536, 1536), (2 * 8960, 1536), (1536, 8960)], 4),
}


def bench_packed_projections(rows_list: list[int], kernels: CpuKernels) -> list[dict]:
    """Every width through torch's bf16 linear, the BF16 GEMV and each packed family without AMX this CPU
    runs (the widening AVX-512 kernel; the VDPBF16PS one; the widening AVX2 one), GFLOP/s; torch's fp32
    linear on fp32 copies of the weights for scale."""
    families = [*(["avx512"] if kernels.avx512 else []), *(["bf16dot"] if kernels.gemv_bf16 else []),
                *(["avx2"] if kernels.avx2 else [])]
    results = []
    for model, (shapes, layers) in PROJECTION_MODELS.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(layers) for n, k in shapes]
        packed = {w.data_ptr(): torch.ops.kvserve.pack_bf16_pairs(w) for w in weights}
        weights_fp32 = [w.float() for w in weights]
        flops_per_row = sum(2 * w.numel() for w in weights)
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in shapes}}
            inputs_fp32 = {k: x.float() for k, x in inputs.items()}
            times = {"torch_bf16": seconds_per_call(lambda: [F.linear(inputs[w.shape[1]], w)  # noqa: B023
                                                             for w in weights]),  # noqa: B023
                     "torch_fp32": seconds_per_call(lambda: [F.linear(inputs_fp32[w.shape[1]], w)  # noqa: B023
                                                             for w in weights_fp32])}  # noqa: B023
            if kernels.gemv_bf16:
                times["gemv"] = seconds_per_call(lambda: [torch.ops.kvserve.gemv_bf16(  # noqa: B023
                    inputs[w.shape[1]], w, None) for w in weights])  # noqa: B023
            for name in families:
                op = getattr(torch.ops.kvserve, f"{name}_linear")
                times[name] = seconds_per_call(lambda: [op(inputs[w.shape[1]], packed[w.data_ptr()], None)  # noqa: B023
                                                        for w in weights])  # noqa: B023
            gflops = rows * flops_per_row / 1e9
            row = {"model": model, "rows": rows, **{f"{name}_gflops": gflops / t for name, t in times.items()}}
            best = min((name for name in times if name != "torch_fp32"), key=times.__getitem__)
            results.append({**row, "fastest": best, "fastest_over_torch_bf16": times["torch_bf16"] / times[best]})
    return results


def bench_attention(cases: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int) -> list[dict]:
    bf16 = torch.bfloat16
    group = heads // kv_heads
    results = []
    for batch, length in cases:
        blocks_per_seq = -(-length // BLOCK)
        cache = torch.randn(2, batch * blocks_per_seq, BLOCK, kv_heads, head_dim, dtype=bf16)
        table = torch.randperm(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
        lens = torch.full((batch,), length, dtype=torch.int32)
        query = torch.randn(batch, kv_heads, group, head_dim, dtype=bf16)
        mask = (torch.arange(blocks_per_seq * BLOCK)[None, :] < lens[:, None])[:, None, None, :]

        def reference() -> torch.Tensor:
            key = cache[0][table].flatten(1, 2).transpose(1, 2)  # noqa: B023
            value = cache[1][table].flatten(1, 2).transpose(1, 2)  # noqa: B023
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)  # noqa: B023

        def kernel() -> object:
            return torch.ops.kvserve.paged_decode(query, cache[0], cache[1], table, lens, head_dim**-0.5, 256)  # noqa: B023

        t_torch, t_kernel = seconds_per_call(reference), seconds_per_call(kernel)
        kv_bytes = batch * length * kv_heads * head_dim * 2 * 2
        results.append({"batch": batch, "keys": length, "torch_us": t_torch * 1e6, "kernel_us": t_kernel * 1e6,
                        "speedup": t_torch / t_kernel, "kernel_kv_gbps": kv_bytes / t_kernel / 1e9})
    return results


def bench_many_row_attention(kernel_name: str, heads: int, kv_heads: int, head_dim: int) -> list[dict]:
    """(label, [(queries, keys) per run], causal) through the kernel (paged_attention_amx,
    paged_attention_avx512 or paged_attention_avx2) and through the torch path, in one head layout."""
    many_rows = getattr(torch.ops.kvserve, kernel_name)
    bf16 = torch.bfloat16
    cases = [("prefill 10 x 100 on 1,568 cached", [(100, 1668)] * 10, True),
             ("prefill 1,024 cold", [(1024, 1024)], True),
             ("decode prefix 16 x 1,568", [(16, 1568)], False)]
    results = []
    for label, runs, causal in cases:
        tables = [torch.randperm(4096)[: -(-kv // BLOCK)].to(torch.int32) for _, kv in runs]
        cache = torch.randn(2, 4096, BLOCK, kv_heads, head_dim, dtype=bf16)
        queries = [torch.randn(q_len, heads, head_dim, dtype=bf16) for q_len, _ in runs]
        q = torch.cat(queries)
        width = max(len(t) for t in tables)
        block_tables = torch.stack([F.pad(t, (0, width - len(t))) for t in tables])
        kv_lens = torch.tensor([kv for _, kv in runs], dtype=torch.int32)
        q_starts = torch.tensor([0, *torch.tensor([n for n, _ in runs]).cumsum(0).tolist()], dtype=torch.int32)
        masks = [torch.arange(kv)[None, :] <= torch.arange(kv - n, kv)[:, None] if causal else None for n, kv in runs]

        def reference() -> None:
            for query, table, (_, kv), mask in zip(queries, tables, runs, masks, strict=True):  # noqa: B023
                key = cache[0][table.long()].flatten(0, 1)[:kv].transpose(0, 1).unsqueeze(0)  # noqa: B023
                value = cache[1][table.long()].flatten(0, 1)[:kv].transpose(0, 1).unsqueeze(0)  # noqa: B023
                F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), key, value, attn_mask=mask,
                                               enable_gqa=True)

        def kernel() -> object:
            return many_rows(q, cache[0], cache[1], block_tables, kv_lens, q_starts, head_dim**-0.5,  # noqa: B023
                             causal, not causal)  # noqa: B023

        t_torch, t_kernel = seconds_per_call(reference), seconds_per_call(kernel)
        flops = sum(4 * n * (kv - (n - 1) / 2 if causal else kv) * heads * head_dim for n, kv in runs)
        result = {"case": label, "torch_ms": t_torch * 1e3, "kernel_ms": t_kernel * 1e3,
                  "speedup": t_torch / t_kernel, "kernel_gflops": flops / t_kernel / 1e9}
        if not causal and kernel_name == "paged_attention_amx":  # the prefix stays packed across steps
            packed = torch.ops.kvserve.pack_kv_amx(cache[0], cache[1], block_tables[0], runs[0][1])

            def kernel_prepacked() -> object:
                return torch.ops.kvserve.paged_attention_amx(q, cache[0], cache[1], block_tables, kv_lens,  # noqa: B023
                                                             q_starts, head_dim**-0.5, False, True, packed)  # noqa: B023

            result["kernel_prepacked_ms"] = seconds_per_call(kernel_prepacked) * 1e3
        results.append(result)
    return results


def bench_elementwise() -> list[dict]:
    bf16 = torch.bfloat16
    x, residual = torch.randn(1, HIDDEN, dtype=bf16), torch.randn(1, HIDDEN, dtype=bf16)
    weight = torch.rand(HIDDEN, dtype=bf16)
    gate_up = torch.randn(1, 2 * INTERMEDIATE, dtype=bf16)
    # Q and K heads as the model passes them: a strided view into the fused QKV output
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=bf16)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(1, HEADS + KV_HEADS, HEAD_DIM)
    cos, sin = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, bf16, torch.device("cpu")).lookup(torch.tensor([100]))
    pairs = {
        "add_rms_norm": (lambda: torch_add_rms_norm(x, residual, weight, 1e-5),
                         lambda: torch.ops.kvserve.add_rms_norm(x, residual, weight, 1e-5)),
        "silu_mul": (lambda: torch_silu_mul(gate_up), lambda: torch.ops.kvserve.silu_mul(gate_up)),
        "rotary": (lambda: apply_rotary(qk, cos, sin), lambda: torch.ops.kvserve.rotary(qk, cos, sin)),
    }
    results = []
    for name, (reference, kernel) in pairs.items():
        t_torch, t_kernel = seconds_per_call(reference), seconds_per_call(kernel)
        results.append({"op": name, "torch_us": t_torch * 1e6, "kernel_us": t_kernel * 1e6,
                        "speedup": t_torch / t_kernel})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    parser.add_argument("--layouts", default=",".join(ATTENTION_LAYOUTS),
                        help=f"attention head layouts, comma-separated, of {', '.join(ATTENTION_LAYOUTS)}")
    parser.add_argument("--only-attention", action="store_true", help="skip the projection and element-wise cases")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ CPU kernels did not build on this machine (see the warning above)")

    report: dict[str, list[dict]] = {}
    layouts = args.layouts.split(",")
    if kernels.gemv_bf16 and not args.only_attention:
        report["gemv"] = bench_gemv([1, 2, 4, 8, 16, 32], kernels.amx)
        print("Projections, bf16, SmolLM2-135M's 30 layers (GB/s of weights read), and its LM head (ms):")
        print("  rows   torch   gemv  ratio    amx  ratio  | lm_head torch  gemv  ratio")
        for r in report["gemv"]:
            print(f"  {r['rows']:4d}  {r['layers_torch_gbps']:6.1f} {r['layers_kernel_gbps']:6.1f}  "
                  f"{r['layers_speedup']:4.2f}x {r['layers_amx_gbps']:6.1f}  {r['layers_amx_speedup']:4.2f}x  |"
                  f"    {r['lm_head_torch_ms']:8.2f} {r['lm_head_kernel_ms']:6.2f}  {r['lm_head_speedup']:4.2f}x")
    if (kernels.avx512 or kernels.avx2) and not args.only_attention:
        report["packed_projections"] = bench_packed_projections([1, 4, 16, 64, 512, 1024], kernels)
        print("\nProjections, bf16, GFLOP/s by width (SmolLM2-135M's 30 layers; 4 of Qwen2.5-Coder-1.5B's):")
        names = [n for n in ("torch_bf16", "gemv", "avx512", "bf16dot", "avx2", "torch_fp32")
                 if f"{n}_gflops" in report["packed_projections"][0]]
        print(f"  {'model':13s} rows  " + "  ".join(f"{n:>10s}" for n in names) + "  fastest (x torch bf16)")
        for r in report["packed_projections"]:
            print(f"  {r['model']:13s} {r['rows']:4d}  " + "  ".join(f"{r[f'{n}_gflops']:10.1f}" for n in names)
                  + f"  {r['fastest']} ({r['fastest_over_torch_bf16']:.2f}x)")
    for layout in layouts:
        heads, kv_heads, head_dim = ATTENTION_LAYOUTS[layout]
        shape = f"{heads} query / {kv_heads} KV heads, head_dim {head_dim}"
        key = "attention" if layout == "smollm2" else f"attention_{layout}"
        report[key] = bench_attention([(1, 512), (1, 2000), (16, 512), (16, 2000), (32, 300)], heads, kv_heads,
                                      head_dim)
        print(f"\nDecode attention, bf16, one layer ({layout}: {shape}), time per call:")
        print("  batch  keys    torch us  kernel us  ratio  kernel KV GB/s")
        for r in report[key]:
            print(f"  {r['batch']:5d}  {r['keys']:5d}  {r['torch_us']:9.0f}  {r['kernel_us']:9.0f}  "
                  f"{r['speedup']:4.2f}x  {r['kernel_kv_gbps']:8.1f}")
        if kernels.amx or kernels.avx512 or kernels.avx2:
            name = ("paged_attention_amx" if kernels.amx else "paged_attention_avx512" if kernels.avx512
                    else "paged_attention_avx2")
            key = "many_row_attention" if layout == "smollm2" else f"many_row_attention_{layout}"
            report[key] = bench_many_row_attention(name, heads, kv_heads, head_dim)
            print(f"\nMany-row attention ({name}), bf16, one layer ({layout}: {shape}), time per call:")
            for r in report[key]:
                print(f"  {r['case']:34s} torch {r['torch_ms']:6.2f} ms  kernel {r['kernel_ms']:6.2f} ms  "
                      f"{r['speedup']:4.2f}x  ({r['kernel_gflops']:.0f} GFLOP/s)")
                if "kernel_prepacked_ms" in r:
                    print(f"  {'  keys pre-packed (kept across steps)':34s} kernel {r['kernel_prepacked_ms']:6.2f} ms"
                          f"  {r['torch_ms'] / r['kernel_prepacked_ms']:4.2f}x")
    if not args.only_attention:
        report["elementwise"] = bench_elementwise()
        print("\nOne-token element-wise ops, bf16:")
        for r in report["elementwise"]:
            print(f"  {r['op']:14s} torch {r['torch_us']:6.1f} us  kernel {r['kernel_us']:6.1f} us  "
                  f"{r['speedup']:4.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
