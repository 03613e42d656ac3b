"""One build of the C++ CPU kernels against another, timed alternately in one process.

    python benchmarks/kernel_ab.py BASE [NEW] [--threads 2] [--reps 15] [--output ab.json]

BASE and NEW are git revisions of this repository (``HEAD~1``, a commit hash) or ``worktree`` (the
files as they are on disk, the default for NEW). Each build's sources are copied to a temporary
directory, registered under an op namespace of their own (``kvab0``, ``kvab1``) and built there, so
both live in this process. Every case then runs on the same inputs through both builds, the order
flipping each repetition; the minimum time per build is kept. On a shared machine, separate runs minutes
apart drift by more than most kernel changes are worth: this is how a change to a kernel is measured.

Cases (SmolLM2-135M's head layout: 9 query heads over 3 KV heads, head_dim 64, blocks of 16):
- decode attention (paged_decode): 16 sequences at 120 and 235 keys, 1 sequence at 2,000 keys. Each
  repetition walks 30 layers' caches with random block tables, so the KV rows come from memory, as in
  a decode step, not from a cache a previous call warmed.
- many-row attention on AMX tiles (paged_attention_amx), where the builds have AMX, else on AVX-512
  (paged_attention_avx512): an agentic prefill step (10 chunks of 100 on 1,568 cached), one cold
  1,024-token prompt, and the shared-prefix half of 16 decodes on a 1,568-token prefix.
- the AMX projections (amx_linear) over SmolLM2's 30 layers of weights, at 16 rows (a decode step) and
  1,024 rows (a prefill step); the MLP's gate/up projection with its SiLU-and-multiply, fused where the
  build has amx_linear_silu_mul, at the same widths.
- a decode step's small per-layer ops at 16 rows (rotary, two add+RMSNorms, the cascade merge).
Prints each case's time per layer for both builds and NEW's speed-up; the outputs of the two builds are
compared too (their largest difference is printed, so a change that alters results is seen at once).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from kvserve.model.cpu_kernels import COMPILE_FLAGS, LINK_FLAGS

ROOT = Path(__file__).resolve().parent.parent
CSRC = "kvserve/model/csrc"
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CACHE_BLOCKS = 1200  # per layer: ~15 MB of K and V; 30 layers, 440 MB, are well past any cache


def copy_sources(revision: str, dest: Path) -> None:
    if revision == "worktree":
        for path in (ROOT / CSRC).iterdir():
            shutil.copy(path, dest / path.name)
        return
    names = subprocess.check_output(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{revision}:{CSRC}"],
                                    text=True).split()
    for name in names:
        text = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{revision}:{CSRC}/{name}"], text=True)
        (dest / name).write_text(text)


def build(revision: str, index: int, workdir: Path) -> object:
    """The ops of one build, under the namespace kvab<index>."""
    src = workdir / f"src{index}"
    src.mkdir()
    copy_sources(revision, src)
    register = src / "register.cpp"
    register.write_text(register.read_text().replace("TORCH_LIBRARY(kvserve,", f"TORCH_LIBRARY(kvab{index},"))
    load(name=f"kvab{index}", sources=sorted(str(p) for p in src.glob("*.cpp")),
         extra_cflags=list(COMPILE_FLAGS), extra_ldflags=list(LINK_FLAGS),
         build_directory=str(src), is_python_module=False, verbose=False)
    return getattr(torch.ops, f"kvab{index}")


def random_caches() -> list[torch.Tensor]:
    """One paged bf16 KV cache [2, blocks, block size, KV heads, head dim] per layer, shared by the cases."""
    return [torch.randn(2, CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]


def decode_case(caches: list[torch.Tensor], batch: int, keys: int) -> Callable[[object], list[torch.Tensor]]:
    """paged_decode over the layers' caches, random block tables: one call per layer."""
    bf16 = torch.bfloat16
    blocks_per_seq = -(-keys // BLOCK)
    tables = [torch.randperm(CACHE_BLOCKS)[: batch * blocks_per_seq].view(batch, -1).to(torch.int32).contiguous()
              for _ in range(LAYERS)]
    query = torch.randn(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, dtype=bf16)
    lens = torch.full((batch,), keys, dtype=torch.int32)

    def run(ops: object) -> list[torch.Tensor]:
        return [ops.paged_decode(query, cache[0], cache[1], table, lens, HEAD_DIM**-0.5, 256)[0]
                for cache, table in zip(caches, tables, strict=True)]
    return run


def many_row_case(caches: list[torch.Tensor], runs: list[tuple[int, int]], causal: bool,
                  kernel: str = "paged_attention_amx") -> Callable[[object], list[torch.Tensor]]:
    """The many-row attention ``kernel`` over the layers' caches; runs are (queries, keys) per span."""
    bf16 = torch.bfloat16
    width = max(-(-kv // BLOCK) for _, kv in runs)
    tables = [torch.stack([torch.randperm(CACHE_BLOCKS)[:width] for _ in runs]).to(torch.int32).contiguous()
              for _ in range(LAYERS)]
    q = torch.randn(sum(n for n, _ in runs), HEADS, HEAD_DIM, dtype=bf16)
    kv_lens = torch.tensor([kv for _, kv in runs], dtype=torch.int32)
    q_starts = torch.tensor([0, *torch.tensor([n for n, _ in runs]).cumsum(0).tolist()], dtype=torch.int32)

    def run(ops: object) -> list[torch.Tensor]:
        return [getattr(ops, kernel)(q, cache[0], cache[1], table, kv_lens, q_starts, HEAD_DIM**-0.5, causal,
                                     not causal)[0]
                for cache, table in zip(caches, tables, strict=True)]
    return run


def projection_case(rows: int) -> Callable[[object], list[torch.Tensor]]:
    """amx_linear over SmolLM2's 30 layers of projections (q/k/v, o, gate/up, down), weights packed per build."""
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    weights = [[torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in shapes] for _ in range(LAYERS)]
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    packed: dict[int, list[list[torch.Tensor]]] = {}

    def run(ops: object) -> list[torch.Tensor]:
        if id(ops) not in packed:
            packed[id(ops)] = [[ops.amx_pack(w) for w in layer] for layer in weights]
        return [ops.amx_linear(inputs[k], w, None)
                for layer in packed[id(ops)] for (_, k), w in zip(shapes, layer, strict=True)]
    return run


def mlp_case(rows: int) -> Callable[[object], list[torch.Tensor]]:
    """The MLP's gate/up projection and SiLU-and-multiply over 30 layers: one fused kernel where the build
    has amx_linear_silu_mul (its weight packed with gate and up interleaved), else silu_mul(amx_linear)."""
    intermediate, hidden = 1536, 576
    weights = [torch.randn(2 * intermediate, hidden, dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    prepared: dict[int, tuple[bool, list[torch.Tensor]]] = {}

    def interleaved(w: torch.Tensor) -> torch.Tensor:
        return w.view(2, intermediate // 16, 16, hidden).transpose(0, 1).reshape(2 * intermediate, hidden).contiguous()

    def run(ops: object) -> list[torch.Tensor]:
        if id(ops) not in prepared:
            try:
                ops.amx_linear_silu_mul  # noqa: B018 - does this build have the fused kernel?
                prepared[id(ops)] = (True, [ops.amx_pack(interleaved(w)) for w in weights])
            except (AttributeError, RuntimeError):
                prepared[id(ops)] = (False, [ops.amx_pack(w) for w in weights])
        fused, packed = prepared[id(ops)]
        if fused:
            return [ops.amx_linear_silu_mul(x, w) for w in packed]
        return [ops.silu_mul(ops.amx_linear(x, w, None)) for w in packed]
    return run


def glue_case(rows: int) -> Callable[[object], list[torch.Tensor]]:
    """A decode step's small per-layer ops at `rows` tokens: rotary on Q and K, the two add+RMSNorms and
    the cascade merge, 30 layers."""
    bf16 = torch.bfloat16
    qk = torch.randn(rows, HEADS + KV_HEADS, HEAD_DIM, dtype=bf16)
    cos, sin = torch.randn(rows, 1, HEAD_DIM, dtype=bf16), torch.randn(rows, 1, HEAD_DIM, dtype=bf16)
    hidden, residual, norm = (torch.randn(rows, 576, dtype=bf16), torch.randn(rows, 576, dtype=bf16),
                              torch.randn(576, dtype=bf16))
    halves = [torch.randn(rows, HEADS, HEAD_DIM), torch.randn(rows, HEADS)] * 2

    def run(ops: object) -> list[torch.Tensor]:
        out = []
        for _ in range(LAYERS):
            out.append(ops.rotary(qk, cos, sin))
            out.append(ops.add_rms_norm(hidden, residual, norm, 1e-5)[0])
            out.append(ops.add_rms_norm(hidden, residual, norm, 1e-5)[0])
            out.append(ops.merge_attention(*halves, True))
        return out
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("new", nargs="?", default="worktree")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kvserve-ab-") as tmp:
        builds = [build(rev, i, Path(tmp)) for i, rev in enumerate((args.base, args.new))]
        caches = random_caches()
        cases: dict[str, Callable[[object], list[torch.Tensor]]] = {
            "decode 16 x 120 keys": decode_case(caches, 16, 120),
            "decode 16 x 235 keys": decode_case(caches, 16, 235),
            "decode 1 x 2,000 keys": decode_case(caches, 1, 2000),
            "decode glue, 16 rows": glue_case(16),
        }
        if all(ops.has_amx() for ops in builds):
            cases |= {
                "prefill 10 x 100 on 1,568 cached": many_row_case(caches, [(100, 1668)] * 10, causal=True),
                "prefill 1,024 cold": many_row_case(caches, [(1024, 1024)], causal=True),
                "decode prefix 16 x 1,568": many_row_case(caches, [(16, 1568)], causal=False),
                "projections, 16 rows": projection_case(16),
                "projections, 1,024 rows": projection_case(1024),
                "MLP gate/up + SiLU, 16 rows": mlp_case(16),
                "MLP gate/up + SiLU, 1,024 rows": mlp_case(1024),
            }
        elif all(ops.has_avx512() for ops in builds):
            kernel = "paged_attention_avx512"
            cases |= {
                "prefill 10 x 100 on 1,568 cached": many_row_case(caches, [(100, 1668)] * 10, True, kernel),
                "prefill 1,024 cold": many_row_case(caches, [(1024, 1024)], True, kernel),
                "decode prefix 16 x 1,568": many_row_case(caches, [(16, 1568)], False, kernel),
            }
        best = {(name, i): float("inf") for name in cases for i in range(2)}
        for rep in range(args.reps):
            for name, run in cases.items():
                for i in ((0, 1) if rep % 2 == 0 else (1, 0)):
                    start = time.perf_counter()
                    run(builds[i])
                    best[(name, i)] = min(best[(name, i)], (time.perf_counter() - start) / LAYERS)
        results = []
        print(f"{args.base} -> {args.new}, {args.threads} threads, min of {args.reps} repetitions, per layer:")
        for name, run in cases.items():
            base_out, new_out = run(builds[0]), run(builds[1])
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(base_out, new_out, strict=True))
            base_us, new_us = best[(name, 0)] * 1e6, best[(name, 1)] * 1e6
            results.append({"case": name, "base_us": base_us, "new_us": new_us, "speedup": base_us / new_us,
                            "max_abs_diff": diff})
            print(f"  {name:34s} {base_us:8.0f} us  {new_us:8.0f} us  {base_us / new_us:5.2f}x   max diff {diff:.2g}")
    if args.output:
        Path(args.output).write_text(json.dumps({"base": args.base, "new": args.new, "threads": args.threads,
                                                 "reps": args.reps, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
