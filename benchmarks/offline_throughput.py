"""Offline throughput: kvserve vs transformers' batched generate, same weights, dtype and thread count.

    python benchmarks/offline_throughput.py [--dtype bfloat16] [--threads 2] [--batches 1,8,32]

Both engines get the same prompts (mixed lengths, real text) and the same per-request output lengths
(mixed too); transformers' static batch pads prompts and runs until its longest request is done, which
is the cost the comparison is about. Reported: useful output tokens/s for each and the ratio, plus
single-stream prefill and decode tokens/s. Ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from kvserve import LLM, SamplingParams

TEXT = (
    "A serving engine turns a model into a service. Requests arrive at random times with prompts of every "
    "length; the engine tokenizes them, looks their prefixes up in the KV cache, prefills what is missing "
    "and then decodes one token at a time for every running request in one batch. "
)


def load_transformers(llm: LLM, dtype: torch.dtype):
    """A transformers Llama built from kvserve's own loaded weights, so both run identical tensors."""
    import transformers

    from kvserve.model.loader import iter_weights

    arch = llm.engine.arch
    config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings, rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps, tie_word_embeddings=arch.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(config).to(dtype)
    state = dict(iter_weights(llm.engine.model_path, arch, dtype, show_progress=False))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.eval()
    return model


def make_workload(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    corpus = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    prompts, outputs = [], []
    for _ in range(n):
        length = rng.randint(32, 512)
        start = rng.randint(0, len(corpus) - length)
        prompts.append(corpus[start : start + length])
        outputs.append(rng.randint(16, 128))
    return prompts, outputs


def run_kvserve(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    assert [len(r.outputs[0].token_ids) for r in results] == outputs
    return sum(outputs) / elapsed


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], outputs: list[int], pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(outputs)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                   do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - t0
    return sum(outputs) / elapsed  # only the tokens the requests asked for are useful


@torch.inference_mode()
def single_stream(llm: LLM, model, prompt: list[int], new_tokens: int) -> dict[str, float]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=new_tokens,
                                                                     ignore_eos=True))[0]
    m = out.metrics
    ks_prefill = len(prompt) / (m.first_token_time - m.first_scheduled_time)
    ks_decode = (new_tokens - 1) / (m.finished_time - m.first_token_time)

    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    model(input_ids=ids)
    hf_prefill = len(prompt) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    model.generate(input_ids=ids[:, :8], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0)
    hf_decode = new_tokens / (time.perf_counter() - t0)  # an 8-token prompt: the time is decode
    return {"kvserve_prefill_tok_s": ks_prefill, "kvserve_decode_tok_s": ks_decode,
            "transformers_prefill_tok_s": hf_prefill, "transformers_decode_tok_s": hf_decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    llm = LLM(dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False, kv_cache_gb=2.0,
              max_num_batched_tokens=2048)
    model = load_transformers(llm, dtype)
    tokenizer = llm.get_tokenizer()
    results: dict[str, object] = {"dtype": args.dtype, "threads": args.threads}

    prompts, _ = make_workload(tokenizer, 1, args.seed)
    corpus = tokenizer.encode(TEXT * 10, add_special_tokens=False)
    single_stream(llm, model, corpus[:64], 4)  # warm-up both
    single = single_stream(llm, model, corpus[:512], 64)
    results["single_stream"] = single
    print(f"single stream ({args.dtype}, {args.threads} threads, 512-token prompt, 64 new tokens):")
    print(f"  prefill  kvserve {single['kvserve_prefill_tok_s']:8.0f} tok/s   "
          f"transformers {single['transformers_prefill_tok_s']:8.0f} tok/s   "
          f"ratio {single['kvserve_prefill_tok_s'] / single['transformers_prefill_tok_s']:.2f}x")
    print(f"  decode   kvserve {single['kvserve_decode_tok_s']:8.1f} tok/s   "
          f"transformers {single['transformers_decode_tok_s']:8.1f} tok/s   "
          f"ratio {single['kvserve_decode_tok_s'] / single['transformers_decode_tok_s']:.2f}x")

    print("\nbatched, mixed prompt (32-512) and output (16-128) lengths; useful output tokens/s:")
    print(f"  {'requests':>8}  {'kvserve':>10}  {'transformers':>12}  {'ratio':>6}")
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts, outputs = make_workload(tokenizer, batch, args.seed + batch)
        ks = run_kvserve(llm, prompts, outputs)
        hf = run_transformers(model, prompts, outputs, pad_id=0)
        results[f"batch_{batch}"] = {"kvserve_tok_s": ks, "transformers_tok_s": hf, "ratio": ks / hf}
        print(f"  {batch:>8}  {ks:>10.1f}  {hf:>12.1f}  {ks / hf:>5.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
