"""The CUDA path checked on a GPU machine in one call: what scripts/gpu_check.sh runs.

    python benchmarks/gpu_check.py OUT_DIR [--device cuda] [--smoke]

Needs nothing downloaded: its models are random-weight Llama checkpoints built here with a small word-level
tokenizer (the real GGUF does not travel), and kvserve from this checkout. The GPU machines have torch,
transformers, tokenizers, numpy and triton; kvserve's offline path also imports gguf, llguidance,
jsonschema (with attrs, referencing, rpds-py, jsonschema-specifications), jinja2, pyyaml and tqdm: the
environment section lists any module missing there, which must then travel as wheels. Writes
OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md:

1. **Environment**: GPU, driver, torch, CUDA, Triton, the backend kvserve chose.
2. **Greedy equality with transformers** on the same device, float32 and bfloat16, prefix cache on (a second
   pass over the prompts, served from the cache) and off, decode steps on CUDA graphs and (cache off) eager,
   on a tiny model, a tiny Gemma 3 (sliding-window layers, a window shorter than the longer prompts) and one
   of SmolLM2-135M's shape: token for token over every prompt (bf16: how many agree, and where each first
   diverges).
   Then the tiny model's prompts served again after other prompts pushed their KV into the host tier.
3. **Throughput**: offline output tokens/s at 1, 16, 64 and 256 concurrent requests (bf16), kvserve with CUDA
   graphs and eager (``--enforce-eager``) against transformers' batched ``generate`` on the same GPU.
   **Shared prefix (cascade decode)**: requests sharing a long system prompt (the shared blocks served from
   the prefix cache), with the prefix read once per step for every request and with each request reading
   its whole table (``--cascade-min-tokens`` past any prompt): tokens/s of both and their tokens compared;
   and the tiny model's shared-prefix prompts against transformers in float32.
4. **Against the H200's peaks** (989 TFLOP/s bf16 dense, 4.8 TB/s): prefill MFU of one 2,048-token prompt,
   and single-stream decode's weight bytes per second.

``--device cpu --smoke`` runs all of it at toy sizes on a CPU (the tests do, so that the script works when a
GPU session gets to run it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

H200_BF16_FLOPS = 989e12
H200_BYTES_PER_S = 4.8e12
OFFLINE_MODULES = ("gguf", "llguidance", "jsonschema", "jinja2", "yaml", "tqdm", "tokenizers", "transformers",
                   "triton")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)
# Gemma 3's layout at toy size: two sliding-window layers (window shorter than the longer prompts) and a global
# one, so that the Triton kernels' windows and the freed window pages are checked against transformers.
TINY_GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=512, sliding_window=16, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=0)


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "missing_modules": [m for m in OFFLINE_MODULES if importlib.util.find_spec(m) is None]}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}")
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    if importlib.util.find_spec("triton") is not None:
        import triton
        env["triton"] = triton.__version__
    return env


def make_model(directory: Path, shape: dict, seed: int, family: str = "llama") -> Path:
    """A random-weight Llama (or Gemma 3) checkpoint (safetensors, float32) with a word-level tokenizer over
    its vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config_class = transformers.Gemma3TextConfig if family == "gemma3" else transformers.LlamaConfig
    config = config_class(**shape, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5,
                          bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that a skipped or swapped norm changes the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def kvserve_generate(model_dir: Path, device: str, dtype: str, token_lists: list[list[int]], max_tokens: int,
                     prefix_caching: bool = True, max_num_seqs: int = 64, passes: int = 1,
                     eager: bool = False, **options: object) -> tuple[list[list[int]], float, str]:
    """The outputs and seconds of the last of ``passes`` runs of the prompts through one engine (a second
    pass finds the first's prompts in the prefix cache); ``eager``: no CUDA graphs; ``options``: more of the
    engine's settings. The backend's description says what ran: its CUDA graphs' sizes and replays, or why
    there were none."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device=device, dtype=dtype, enable_prefix_caching=prefix_caching,
              max_num_seqs=max_num_seqs, enforce_eager=eager, **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": token_lists[0][:4]}], SamplingParams(max_tokens=2))  # warm-up
    for _ in range(passes):
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": t} for t in token_lists], params)
        seconds = time.perf_counter() - start
    backend = llm.engine.backend.description + graphs_used(llm.engine.model.fused_decode)
    del llm
    return [list(o.outputs[0].token_ids) for o in outputs], seconds, backend


def graphs_used(fused_decode: object) -> str:
    """What the engine's CUDA graphs did: sizes captured and decode steps replayed, or the capture's error."""
    if fused_decode is None or not hasattr(fused_decode, "capture_error"):
        return "; no CUDA graphs"
    if fused_decode.capture_error is not None:
        return f"; CUDA graph capture FAILED, eager: {fused_decode.capture_error}"
    return f"; CUDA graphs: {len(fused_decode.steps)} sizes captured, {fused_decode.num_replays} steps replayed"


def transformers_generate(model_dir: Path, device: str, dtype: torch.dtype, token_lists: list[list[int]],
                          max_tokens: int, batched: bool) -> tuple[list[list[int]], float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    groups = [token_lists] if batched else [[t] for t in token_lists]  # batched: prompts of one length
    with torch.no_grad():
        model.generate(torch.tensor([token_lists[0][:4]], device=device), max_new_tokens=2, pad_token_id=0)
        start = time.perf_counter()
        out = []
        for group in groups:
            ids = torch.tensor(group, device=device)
            out += [row[ids.shape[1]:].tolist() for row in model.generate(ids, **kwargs)]
        if device == "cuda":
            torch.cuda.synchronize()
    return out, time.perf_counter() - start


def equality(model_dir: Path, device: str, vocab_size: int, lengths: list[int], max_tokens: int) -> list[dict]:
    rows = []
    token_lists = prompts(vocab_size, lengths, seed=1)
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        expected, _ = transformers_generate(model_dir, device, dtype, token_lists, max_tokens, batched=False)
        for prefix_caching, eager in ((True, False), (False, False), (False, True)):
            # With the cache on, the second pass: its prompts' full blocks come from the first pass's KV.
            got, _, backend = kvserve_generate(model_dir, device, dtype_name, token_lists, max_tokens,
                                               prefix_caching, passes=2 if prefix_caching else 1, eager=eager)
            first_diff = [next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
                          for g, e in zip(got, expected, strict=True)]
            rows.append({"model": model_dir.name, "dtype": dtype_name, "prefix_caching": prefix_caching,
                         "cuda_graphs": not eager, "backend": backend, "prompts": len(token_lists),
                         "equal": sum(d is None for d in first_diff), "first_divergence": first_diff})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def tier_equality(model_dir: Path, device: str, vocab_size: int, lengths: list[int], max_tokens: int) -> dict:
    """Prompts served again after other prompts pushed their KV out of a small device pool into the host tier:
    their blocks come back from the host (the offloads' copies on a side stream, the loads through pinned
    memory), and the tokens still equal transformers' (float32)."""
    from kvserve import LLM, SamplingParams

    token_lists = prompts(vocab_size, lengths, seed=1)
    expected, _ = transformers_generate(model_dir, device, torch.float32, token_lists, max_tokens, batched=False)
    blocks = sum(-(-(n + max_tokens) // 16) for n in lengths) + 4  # room for one pass's requests at a time
    llm = LLM(model=str(model_dir), device=device, dtype="float32", num_kv_blocks=blocks, kv_host_gb=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": t} for t in token_lists], params)
    llm.generate([{"prompt_token_ids": t} for t in prompts(vocab_size, lengths, seed=2)], params)  # evicts them
    outputs = llm.generate([{"prompt_token_ids": t} for t in token_lists], params)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    row = {"model": model_dir.name, "dtype": "float32", "prompts": len(token_lists),
           "equal": sum(g == e for g, e in zip(got, expected, strict=True)),
           "cached_tokens_by_tier": dict(llm.engine.stats().cached_tokens_by_tier)}
    print(json.dumps(row), flush=True)
    return row


def throughput(model_dir: Path, device: str, vocab_size: int, levels: list[int], prompt_len: int,
               max_tokens: int) -> list[dict]:
    rows = []
    for concurrency in levels:
        token_lists = prompts(vocab_size, [prompt_len] * concurrency, seed=concurrency)
        _, seconds, _ = kvserve_generate(model_dir, device, "bfloat16", token_lists, max_tokens,
                                         max_num_seqs=concurrency)
        _, eager_seconds, _ = kvserve_generate(model_dir, device, "bfloat16", token_lists, max_tokens,
                                               max_num_seqs=concurrency, eager=True)
        _, hf_seconds = transformers_generate(model_dir, device, torch.bfloat16, token_lists, max_tokens,
                                              batched=True)
        tokens = concurrency * max_tokens
        rows.append({"concurrency": concurrency, "kvserve_tok_s": tokens / seconds,
                     "kvserve_eager_tok_s": tokens / eager_seconds, "transformers_tok_s": tokens / hf_seconds,
                     "ratio": hf_seconds / seconds, "graphs_over_eager": eager_seconds / seconds})
        print(json.dumps(rows[-1]), flush=True)
    return rows


NO_CASCADE = 1 << 30  # --cascade-min-tokens past any prompt: every decode row reads its whole table


def shared_prefix_prompts(vocab_size: int, concurrency: int, prefix_len: int, tail_len: int) -> list[list[int]]:
    (shared,) = prompts(vocab_size, [prefix_len], seed=3)
    return [shared + tail for tail in prompts(vocab_size, [tail_len] * concurrency, seed=4)]


def shared_prefix_equality(model_dir: Path, device: str, vocab_size: int, max_tokens: int) -> dict:
    """Prompts sharing 64 tokens (four blocks) before tails of their own, served again from the prefix cache so
    that every decode step's rows share those blocks: cascade decode's tokens against transformers' (float32)."""
    token_lists = shared_prefix_prompts(vocab_size, 4, 64, 9)
    expected, _ = transformers_generate(model_dir, device, torch.float32, token_lists, max_tokens, batched=False)
    got, _, backend = kvserve_generate(model_dir, device, "float32", token_lists, max_tokens, passes=2,
                                       cascade_min_tokens=16)
    row = {"model": model_dir.name, "dtype": "float32", "prompts": len(token_lists), "backend": backend,
           "equal": sum(g == e for g, e in zip(got, expected, strict=True))}
    print(json.dumps(row), flush=True)
    return row


def shared_prefix_throughput(model_dir: Path, device: str, vocab_size: int, levels: list[int], prefix_len: int,
                             tail_len: int, max_tokens: int) -> list[dict]:
    """Output tokens/s of requests sharing a ``prefix_len``-token prompt prefix (from the prefix cache: the
    timed pass is the second), cascade decode against whole tables, both on CUDA graphs (bf16)."""
    rows = []
    for concurrency in levels:
        token_lists = shared_prefix_prompts(vocab_size, concurrency, prefix_len, tail_len)
        runs = {name: kvserve_generate(model_dir, device, "bfloat16", token_lists, max_tokens,
                                       max_num_seqs=concurrency, passes=2, cascade_min_tokens=min_tokens)
                for name, min_tokens in (("cascade", 16), ("whole_tables", NO_CASCADE))}
        tokens = concurrency * max_tokens
        (cascade, cascade_seconds, _), (whole, whole_seconds, _) = runs["cascade"], runs["whole_tables"]
        rows.append({"concurrency": concurrency, "prefix_len": prefix_len, "cascade_tok_s": tokens / cascade_seconds,
                     "whole_tables_tok_s": tokens / whole_seconds, "cascade_over_whole": whole_seconds / cascade_seconds,
                     "same_tokens": sum(a == b for a, b in zip(cascade, whole, strict=True))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def peaks(model_dir: Path, device: str, vocab_size: int, prompt_len: int, decode_tokens: int) -> dict:
    """Prefill MFU of one prompt and single-stream decode's weight bytes per second (bf16)."""
    import transformers

    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    (prompt,) = prompts(vocab_size, [prompt_len], seed=7)
    _, prefill_seconds, _ = kvserve_generate(model_dir, device, "bfloat16", [prompt], 1)
    _, seconds, _ = kvserve_generate(model_dir, device, "bfloat16", [prompt[:16]], decode_tokens)
    flops = 2 * params * prompt_len
    decode_bytes_per_s = 2 * params * decode_tokens / seconds
    return {"parameters": params, "prefill_tok_s": prompt_len / prefill_seconds,
            "prefill_mfu": flops / prefill_seconds / H200_BF16_FLOPS,
            "decode_tok_s": decode_tokens / seconds, "decode_bandwidth_use": decode_bytes_per_s / H200_BYTES_PER_S}


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"# CUDA check: {env.get('gpu', results['device'])}", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "| model | dtype | prefix cache | CUDA graphs | backend | prompts equal to transformers | first divergence |",
             "|---|---|---|---|---|---:|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['prefix_caching']} | {r['cuda_graphs']} | {r['backend']} | "
              f"{r['equal']} of {r['prompts']} | {r['first_divergence']} |" for r in results["equality"]]
    lines += ["", "| concurrency | kvserve tok/s (CUDA graphs) | eager | graphs / eager | transformers tok/s | "
              "kvserve / transformers |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['concurrency']} | {r['kvserve_tok_s']:.1f} | {r['kvserve_eager_tok_s']:.1f} | "
              f"{r['graphs_over_eager']:.2f}x | {r['transformers_tok_s']:.1f} | {r['ratio']:.2f}x |"
              for r in results["throughput"]]
    c = results["shared_prefix_equality"]
    lines += ["", f"Shared prefix, cascade decode: {c['equal']} of {c['prompts']} prompts equal to transformers "
              f"(float32, {c['model']}; {c['backend']}).", "",
              "| concurrency | shared prefix tokens | cascade tok/s | whole tables tok/s | cascade / whole | "
              "same tokens (bf16) |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['concurrency']} | {r['prefix_len']} | {r['cascade_tok_s']:.1f} | {r['whole_tables_tok_s']:.1f} | "
              f"{r['cascade_over_whole']:.2f}x | {r['same_tokens']} of {r['concurrency']} |"
              for r in results["shared_prefix"]]
    t = results["host_tier"]
    lines += ["", f"Host tier: {t['equal']} of {t['prompts']} prompts served again from the host tier equal to "
              f"transformers (float32); cached prompt tokens by tier: {t['cached_tokens_by_tier']}."]
    p = results["peaks"]
    lines += ["", f"Prefill {p['prefill_tok_s']:.0f} tok/s (MFU {100 * p['prefill_mfu']:.2f}% of 989 TFLOP/s); "
              f"decode {p['decode_tok_s']:.1f} tok/s ({100 * p['decode_bandwidth_use']:.2f}% of 4.8 TB/s)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (a CPU run of the whole script)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": args.device, "environment": environment(args.device), "argv": sys.argv[1:]}
    print(json.dumps(results["environment"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_model(Path(tmp) / "tiny-llama", TINY, seed=0)
        shaped = tiny if args.smoke else make_model(Path(tmp) / "smollm2-shape-random", SMOLLM2_SHAPE, seed=0)
        lengths, max_tokens = ([3, 17, 40], 8) if args.smoke else ([5, 17, 40, 130], 32)
        results["equality"] = equality(tiny, args.device, TINY["vocab_size"], lengths, max_tokens)
        results["host_tier"] = tier_equality(tiny, args.device, TINY["vocab_size"], lengths, max_tokens)
        gemma = make_model(Path(tmp) / "tiny-gemma3", TINY_GEMMA3, seed=0, family="gemma3")
        results["equality"] += equality(gemma, args.device, TINY_GEMMA3["vocab_size"], lengths, max_tokens)
        if not args.smoke:
            results["equality"] += equality(shaped, args.device, SMOLLM2_SHAPE["vocab_size"], lengths, max_tokens)
        vocab = (TINY if args.smoke else SMOLLM2_SHAPE)["vocab_size"]
        levels, prompt_len, out_len = ([1, 4], 16, 8) if args.smoke else ([1, 16, 64, 256], 128, 128)
        results["throughput"] = throughput(shaped, args.device, vocab, levels, prompt_len, out_len)
        results["shared_prefix_equality"] = shared_prefix_equality(tiny, args.device, TINY["vocab_size"], max_tokens)
        shared_levels, shared_len = ([4], 64) if args.smoke else ([16, 64, 256], 1024)
        results["shared_prefix"] = shared_prefix_throughput(shaped, args.device, vocab, shared_levels, shared_len,
                                                            16, 8 if args.smoke else 64)
        results["peaks"] = peaks(shaped, args.device, vocab, 64 if args.smoke else 2048, 8 if args.smoke else 128)
    (args.out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1))
    (args.out_dir / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
