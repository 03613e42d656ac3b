"""A mixture-of-experts model (grouped experts, model/moe.py) against a dense model of the same active size,
prefill and decode, side by side in one run.

    python benchmarks/moe.py [--threads 2] [--dtype bfloat16] [--repeats 3] [--output results.json]

Two random-weight checkpoints with the same attention, embeddings and layer count (Qwen3 layout, 8 layers,
hidden 1024, 16 query heads over 4 KV heads of 64, SmolLM2's 49,152-token vocabulary):

- MoE (``qwen3_moe``): 32 experts of 512 per layer, 4 per token, renormalised top-k;
- dense (``qwen3``): one MLP of 4 x 512 = 2048 per layer, the weights a token of the MoE model uses.

Both run through ``LLM`` (the prefix cache off), alternating MoE and dense per measurement; each figure is
the median over ``--repeats``. Prefill: 4 prompts of 512 tokens, one output token each, in one 2,048-token
step; tokens per second. Decode: batches of 1, 8 and 32 short prompts; the time of one decode step, from a
run with 33 output tokens minus a run with 1. MoE over dense is the cost of routing and of reading more
expert weights once the batch's tokens spread over more experts (at 32 tokens, nearly all 32 of each layer);
the last column is what the cost model (``kvserve.costs.weight_bytes_read``, uniform routing) expects of
the weights a step reads, MoE over dense: decode on the CPU is bound by that read.
The checkpoints are written once to ``--work-dir`` (a temporary directory by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
         "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
NUM_EXPERTS, TOP_K, EXPERT_SIZE = 32, 4, 512
PREFILL_PROMPTS, PREFILL_LEN = 4, 512
DECODE_BATCHES, DECODE_STEPS, DECODE_PROMPT_LEN = (1, 8, 32), 32, 16


def write_checkpoint(work_dir: Path, moe: bool) -> Path:
    """A random bf16 checkpoint with the SmolLM2 tokenizer, written once."""
    import transformers

    from kvserve.model.loader import resolve_model_path
    from kvserve.tokenizer import Tokenizer

    model_dir = work_dir / ("moe" if moe else "dense")
    if (model_dir / "model.safetensors").is_file():
        return model_dir
    tokenizer = Tokenizer.from_model_path(resolve_model_path(None))
    common = dict(SHAPE, vocab_size=tokenizer.vocab_size)
    if moe:
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=TOP_K * EXPERT_SIZE, num_experts=NUM_EXPERTS,
                                             num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_SIZE,
                                             norm_topk_prob=True)
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=TOP_K * EXPERT_SIZE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save(model_dir)
    return model_dir


def seconds(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start


def measure(llms: dict[str, object], repeats: int, vocab: int) -> dict[str, dict[str, float]]:
    generator = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(0, vocab, (n, length), generator=generator).tolist()

    samples: dict[str, dict[str, list[float]]] = {name: {} for name in llms}
    prefill = prompts(PREFILL_PROMPTS, PREFILL_LEN)
    decodes = {batch: prompts(batch, DECODE_PROMPT_LEN) for batch in DECODE_BATCHES}
    for llm in llms.values():  # warm-up
        seconds(llm, prefill[:1], 2)
    for _ in range(repeats):
        for name, llm in llms.items():
            figures = samples[name]
            t = seconds(llm, prefill, 1)
            figures.setdefault("prefill_tok_s", []).append(PREFILL_PROMPTS * PREFILL_LEN / t)
            for batch, batch_prompts in decodes.items():
                step = (seconds(llm, batch_prompts, DECODE_STEPS + 1) - seconds(llm, batch_prompts, 1)) / DECODE_STEPS
                figures.setdefault(f"decode_ms_batch{batch}", []).append(step * 1e3)
    return {name: {key: statistics.median(values) for key, values in figures.items()}
            for name, figures in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cpu-kernels", action="store_true", help="the torch reference backend")
    parser.add_argument("--work-dir", default=None, help="where the two checkpoints are written (and reused)")
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvserve import LLM
    from kvserve.costs import weight_bytes_read

    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="kvserve-moe-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    llms = {name: LLM(str(write_checkpoint(work_dir, name == "moe")), dtype=args.dtype, num_threads=args.threads,
                      cpu_kernels=not args.no_cpu_kernels, enable_prefix_caching=False, kv_cache_gb=1.0,
                      max_num_batched_tokens=PREFILL_PROMPTS * PREFILL_LEN, show_progress=False)
            for name in ("moe", "dense")}
    moe_arch = llms["moe"].engine.arch
    active, total = moe_arch.active_params(), moe_arch.total_params()
    dense_params = llms["dense"].engine.arch.total_params()
    dense_arch = llms["dense"].engine.arch
    results = measure(llms, args.repeats, moe_arch.vocab_size)
    step_tokens = {"prefill_tok_s": PREFILL_PROMPTS * PREFILL_LEN} | {
        f"decode_ms_batch{batch}": batch for batch in DECODE_BATCHES}

    print(f"{args.dtype}, {args.threads} threads, backend: {llms['moe'].engine.backend.description}")
    print(f"MoE: {NUM_EXPERTS} experts of {EXPERT_SIZE}, {TOP_K} per token; {total / 1e6:.0f}M weights, "
          f"{active / 1e6:.0f}M active per token;  dense: {dense_params / 1e6:.0f}M weights")
    print(f"  {'':<26} {'MoE':>10} {'dense':>10} {'MoE/dense':>10} {'weights read':>13}")
    moe, dense = results["moe"], results["dense"]
    for key in moe:
        unit = "tok/s" if key.endswith("tok_s") else "ms/step"
        label = key.replace("_tok_s", "").replace("_ms_", " ").replace("batch", "batch ")
        read = weight_bytes_read(moe_arch, step_tokens[key]) / weight_bytes_read(dense_arch, step_tokens[key])
        print(f"  {label + ' (' + unit + ')':<26} {moe[key]:10.1f} {dense[key]:10.1f} {moe[key] / dense[key]:10.2f} "
              f"{read:13.2f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"dtype": args.dtype, "threads": args.threads, **results}, indent=2))


if __name__ == "__main__":
    main()
