"""What LoRA adapters cost: output tokens/s of one batch run on the base model alone, on one adapter, on several
adapters mixed in the batch, and half base / half adapter, side by side in one run (offline ``LLM``, the default
model and precision).

    python benchmarks/lora.py [--requests 16] [--output-len 64] [--rank 16] [--adapters 4] [--rounds 3]
                              [--output FILE]

The adapters are random (PEFT's file layout, every projection targeted, B scaled down so that the text stays
text): what they cost does not depend on what they learnt. Each round runs every case once, in a rotated order;
the report gives each case's median tokens/s and its ratio to the base model's in the same round. Concurrency 1
(one request at a time) is measured too: a single stream's decode, where the base model runs its fused decode
stack and an adapter's rows cannot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.config import ArchConfig
from kvserve.model.lora import module_shapes

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def random_adapter(directory: Path, arch: ArchConfig, rank: int, seed: int) -> Path:
    """A random LoRA adapter on every projection of every layer, written as PEFT writes one."""
    sizes = module_shapes(arch)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, kind in PROJECTIONS.items():
            out_size, in_size = sizes[module]
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_size, generator=generator) / in_size ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_size, rank, generator=generator) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": list(PROJECTIONS)}))
    return directory


def run_case(llm: LLM, prompts: list[str], loras: Sequence[LoRARequest | None], output_len: int,
             concurrency: int) -> float:
    """Output tokens/s of the prompts, ``concurrency`` at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), concurrency):
        outputs = llm.generate(prompts[i:i + concurrency], params, lora_request=list(loras[i:i + concurrency]))
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single-requests", type=int, default=2, help="requests run one at a time (concurrency 1)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    llm = LLM()
    arch = llm.engine.arch
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(random_adapter(Path(tmp) / f"a{i}", arch, args.rank, i)))
                    for i in range(args.adapters)]
        prompts = [f"Request {i}: write a short story about a lighthouse keeper who finds a message in a bottle, "
                   f"told in the first person, with a twist at the end number {i}." for i in range(args.requests)]
        n = args.requests
        cases: dict[str, tuple[int, list[LoRARequest | None]]] = {
            "base model": (n, [None] * n),
            "one adapter": (n, [adapters[0]] * n),
            f"{args.adapters} adapters mixed": (n, [adapters[i % len(adapters)] for i in range(n)]),
            "half base, half one adapter": (n, [adapters[0] if i % 2 else None for i in range(n)]),
            "base model, one at a time": (1, [None] * args.single_requests),
            "one adapter, one at a time": (1, [adapters[0]] * args.single_requests),
        }
        for concurrency, loras in cases.values():  # warm-up: every case's step shapes once, untimed
            run_case(llm, prompts[:len(loras)], loras, 8, concurrency)
        rounds: list[dict[str, float]] = []
        names = list(cases)
        for r in range(args.rounds):
            figures = {}
            for name in names[r % len(names):] + names[:r % len(names)]:
                concurrency, loras = cases[name]
                figures[name] = run_case(llm, prompts[:len(loras)], loras, args.output_len, concurrency)
            rounds.append(figures)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    report = {"requests": n, "output_len": args.output_len, "rank": args.rank, "adapters": args.adapters,
              "rounds": rounds, "cases": {}}
    for name, (concurrency, _) in cases.items():
        base = "base model" if concurrency > 1 else "base model, one at a time"
        report["cases"][name] = {
            "tokens_per_s_median": statistics.median(f[name] for f in rounds),
            "vs_base_median": statistics.median(f[name] / f[base] for f in rounds)}
    print(json.dumps(report["cases"], indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
