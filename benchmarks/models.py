"""Prefill and decode tokens/s of each real model: kvserve against transformers and llama.cpp, side by side.

    python benchmarks/models.py [--models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,gemma-3-270m]
        [--dtype bfloat16] [--threads 2] [--prompt-len 256] [--gen-len 64] [--concurrency 16] [--repeats 1]
        [--llama-bench /path/to/llama-bench] [--llama-server /path/to/llama-server] [--int8-activations]
        [--int16-activations] [--json out.json]

For every model (pulled with `kvserve models pull NAME`), one process measures in turn, on the same GGUF,
dtype and thread count:

- **kvserve** (``LLM``, prefix cache off so every prompt is computed): single-stream prefill (a prompt of
  ``--prompt-len`` tokens, time to its first token) and decode (the next ``--gen-len`` tokens); then
  ``--concurrency`` requests at once: prefill tokens/s until the last first token, decode tokens/s after it.
  kvserve runs its defaults (``--quantized-activations auto``: int8 activations for the known models whose
  quality with them is checked, int16 for the others). With ``--int8-activations`` or ``--int16-activations``,
  the same again as **kvserve-int8** or **kvserve-int16** (``--quantized-activations int8`` or ``int16``).
- **transformers**, its model class built from the same dequantised weights: one forward over the prompts
  keeping the last position's logits (prefill), then ``generate`` with its KV cache (decode: a generate of
  ``--gen-len`` tokens less one of a single token), batch 1 and a batch of ``--concurrency`` prompts of
  equal length (no padding).
- **llama.cpp** when ``--llama-bench`` names its binary (../shared/PEERS.md builds it): ``llama-bench``'s
  single-stream pp/tg at the same lengths and threads; and when ``--llama-server`` names that binary, the
  ``--concurrency`` requests at once through ``llama-server -np N -cb`` (continuous batching), timed as
  kvserve's are: the same token ids streamed from ``/completion``, prompt cache off, EOS ignored.

With ``--repeats N`` each kvserve figure is the median of N runs on one engine, and transformers' prefill the
median of N forwards (its decode is one long and one short generate). Ratios are printed per model; the
machines are shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.loader import iter_weights, resolve_model_path
from kvserve.model_store import KNOWN_MODELS


@dataclass
class Speed:
    engine: str
    model: str
    concurrency: int
    prefill_tok_s: float
    decode_tok_s: float


def _prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    # Random ids away from the special tokens at both ends of every vocabulary: distinct prompts, no cache hits.
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, min(vocab_size, 30000), (count, length), generator=generator).tolist()


def bench_kvserve(name: str, dtype: str, prompts: list[list[int]], gen_len: int, repeats: int,
                  activations: str = "auto") -> Speed:
    """The median prefill and decode rates of ``repeats`` runs of the prompts on one engine."""
    llm = LLM(model=name, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=4096,
              max_num_seqs=max(len(prompts), 1), num_kv_blocks=max(64, len(prompts) * 40),
              quantized_activations=activations)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4))  # warm-up
    prefills, decodes = [], []
    for _ in range(repeats):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        first = max(o.metrics.first_token_time for o in outputs)
        last = max(o.metrics.finished_time for o in outputs)
        arrival = min(o.metrics.arrival_time for o in outputs)
        prefills.append(sum(len(p) for p in prompts) / (first - arrival))
        decodes.append(len(prompts) * (gen_len - 1) / (last - first))
    engine = "kvserve" if activations == "auto" else f"kvserve-{activations}"
    return Speed(engine, name, len(prompts), statistics.median(prefills), statistics.median(decodes))


def _hf_config(arch):
    import transformers

    common = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
                  num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
                  num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                  max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.rms_norm_eps,
                  tie_word_embeddings=arch.tie_word_embeddings)
    if arch.architecture == "gemma3":
        kinds = ["sliding_attention" if i in arch.sliding_layers else "full_attention" for i in range(arch.num_layers)]
        return transformers.Gemma3TextConfig(**common, sliding_window=arch.sliding_window, layer_types=kinds,
                                             query_pre_attn_scalar=int(arch.query_pre_attn_scalar or arch.head_dim),
                                             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": arch.rope_theta},
                                                              "sliding_attention": {"rope_type": "default", "rope_theta": arch.rope_local_theta}})
    if arch.architecture == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=arch.rope_theta)
    return transformers.LlamaConfig(**common, rope_theta=arch.rope_theta)


def load_transformers(name: str, torch_dtype: torch.dtype):
    """transformers' model class on the same dequantised GGUF weights kvserve loads (no second GGUF parse)."""
    import transformers

    from kvserve.model.loader import read_arch_config

    path = resolve_model_path(name)
    arch = read_arch_config(path)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(arch), dtype=torch_dtype)
    state = dict(iter_weights(path, arch, torch_dtype, show_progress=False))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model.eval(), arch


def bench_transformers(model, name: str, prompts: list[list[int]], gen_len: int, repeats: int) -> Speed:
    """Prefill: the median of ``repeats`` forwards over the prompts with the last position's logits only, as
    ``generate`` computes them (all of them would cost Gemma's 262k-row output projection on every prompt
    token). Decode: a ``generate`` of ``gen_len`` tokens less one of a single token, so both runs pay the
    same prefill."""
    ids = torch.tensor(prompts)

    def generate_s(num_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
        return time.perf_counter() - start

    with torch.no_grad():
        model(ids[:, :16], logits_to_keep=1)  # warm-up
        prefill_times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids, logits_to_keep=1)
            prefill_times.append(time.perf_counter() - start)
        prefill_s = statistics.median(prefill_times)
        decode_s = max(generate_s(gen_len) - generate_s(1), 1e-9)
    return Speed("transformers", name, len(prompts), ids.numel() / prefill_s, len(prompts) * (gen_len - 1) / decode_s)


def bench_llama_cpp(binary: str, name: str, threads: int, prompt_len: int, gen_len: int) -> Speed:
    path = resolve_model_path(name)
    out = subprocess.run([binary, "-m", str(path), "-t", str(threads), "-p", str(prompt_len), "-n", str(gen_len),
                          "-r", "2", "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return Speed("llama.cpp", name, 1, pp, tg)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bench_llama_server(binary: str, name: str, threads: int, prompts: list[list[int]], gen_len: int) -> Speed:
    """``len(prompts)`` streamed completions at once from llama-server's continuous batching, one slot each."""
    import httpx

    path = resolve_model_path(name)
    port = _free_port()
    slots = len(prompts)
    context = slots * (len(prompts[0]) + gen_len + 16)
    server = subprocess.Popen([binary, "-m", str(path), "-t", str(threads), "-c", str(context), "-np", str(slots),
                               "-cb", "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=600) as client:
            for _ in range(600):
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError("llama-server did not come up")
            body = {"n_predict": 4, "ignore_eos": True, "cache_prompt": False, "temperature": 0}
            client.post(f"{url}/completion", json={**body, "prompt": prompts[0][:32]})  # warm-up
        first: list[float] = []
        last: list[float] = []
        lock = threading.Lock()

        def one(prompt: list[int]) -> None:
            request = {**body, "prompt": prompt, "n_predict": gen_len, "stream": True}
            got_first = None
            with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/completion", json=request) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and got_first is None:
                        got_first = time.perf_counter()
            with lock:
                first.append(got_first or time.perf_counter())
                last.append(time.perf_counter())

        start = time.perf_counter()
        workers = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
    prefill = sum(len(p) for p in prompts) / (max(first) - start)
    decode = slots * (gen_len - 1) / (max(last) - max(first))
    return Speed("llama.cpp", name, slots, prefill, decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(m.name for m in KNOWN_MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench binary")
    parser.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--repeats", type=int, default=1,
                        help="kvserve's runs and transformers' prefills per figure (the median is kept)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--int8-activations", action="store_true",
                        help="also kvserve with --quantized-activations int8 (kvserve-int8)")
    parser.add_argument("--int16-activations", action="store_true",
                        help="also kvserve with --quantized-activations int16 (kvserve-int16)")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch_dtype = getattr(torch, args.dtype)

    results: list[Speed] = []
    for name in args.models.split(","):
        from kvserve.model.loader import read_arch_config

        vocab = read_arch_config(resolve_model_path(name)).vocab_size
        single = _prompts(vocab, 1, args.prompt_len, seed=1)
        many = _prompts(vocab, args.concurrency, args.prompt_len, seed=2)
        rows = [bench_kvserve(name, args.dtype, single, args.gen_len, args.repeats),
                bench_kvserve(name, args.dtype, many, args.gen_len, args.repeats)]
        for activations in [a for a, asked in (("int8", args.int8_activations), ("int16", args.int16_activations))
                            if asked]:
            rows += [bench_kvserve(name, args.dtype, prompts, args.gen_len, args.repeats, activations=activations)
                     for prompts in (single, many)]
        if not args.skip_transformers:
            model, _ = load_transformers(name, torch_dtype)
            rows += [bench_transformers(model, name, single, args.gen_len, args.repeats),
                     bench_transformers(model, name, many, args.gen_len, args.repeats)]
            del model
        if args.llama_bench:
            rows.append(bench_llama_cpp(args.llama_bench, name, args.threads, args.prompt_len, args.gen_len))
        if args.llama_server:
            rows.append(bench_llama_server(args.llama_server, name, args.threads, many, args.gen_len))
        for row in rows:
            print(f"{row.model:20s} {row.engine:13s} c={row.concurrency:<3d} prefill {row.prefill_tok_s:9.1f} tok/s  "
                  f"decode {row.decode_tok_s:8.1f} tok/s", flush=True)
        for engine in ("kvserve", "kvserve-int8", "kvserve-int16"):
            ours = {r.concurrency: r for r in rows if r.engine == engine}
            for row in rows:
                if not row.engine.startswith("kvserve") and row.concurrency in ours:
                    mine = ours[row.concurrency]
                    print(f"{'':20s} {engine} / {row.engine} at c={row.concurrency}: prefill "
                          f"{mine.prefill_tok_s / row.prefill_tok_s:.2f}x, "
                          f"decode {mine.decode_tok_s / row.decode_tok_s:.2f}x")
        results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
