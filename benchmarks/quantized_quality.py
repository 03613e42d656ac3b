"""How far each way of running a quantised GGUF moves the model's next-token distributions from the same file
dequantised to float32: the activations' precision, measured as llama.cpp's perplexity tool measures a
quantisation (KL divergence and top-token agreement), beside the greedy agreement the tests check.

    python benchmarks/quantized_quality.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--tokens 2048]
        [--rows 2048,16,1] [--json out.json]

For every model (pulled with `kvserve models pull NAME`), over the first ``--tokens`` tokens of
tests/data/perplexity.txt (code and prose), each position's distribution given the text before it
(teacher-forced), through:

- **float32, dequantised** (``--quantization none --dtype float32``): the reference;
- **bf16, dequantised** (``--quantization none``): bf16 weights, activations and KV cache;
- **quantised, int16 activations** (``--quantization gguf --quantized-activations int16``, the default for
  files the catalog does not mark for int8): the GGUF blocks' int8 dot products with one int8 level up to
  QUANTIZED_GEMV_MAX_ROWS rows and two (about 16 bits) up to the interleaved limit, the dequantised slabs on
  VDPBF16PS past it;
- **quantised, int8 activations** (``--quantized-activations int8``, the default for the known models the
  catalog marks): one int8 level per 32 values at every width, as llama.cpp's CPU kernels take them (where
  the build has the interleaved kernels).

The text is fed ``--rows`` tokens per forward, once per value, so that each width's kernels are measured (a
whole prefill, a decode batch's width, one row). Printed per path and width: perplexity, the mean and 99th
percentile of KL(reference || path) in nats, and the share of positions whose most likely token is the
reference's. Then the tests' greedy check (tests/data/agreement_prompts.json, 32 tokens), batched as the
test runs them and one prompt at a time: how many prompts agree all the way with the bf16 dequantised run
and with the float32 one, each run the same way.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.backends.base import PrefillChunk, StepRows

DATA = Path(__file__).parents[1] / "tests" / "data"
BLOCK_SIZE = 16
REFERENCE_ROWS = 256
AGREEMENT_TOKENS = 32

# name -> (quantization, dtype, activations)
PATHS = {
    "float32 dequantised": ("none", "float32", "int16"),
    "bf16 dequantised": ("none", "bfloat16", "int16"),
    "quantised, int16 activations": ("gguf", "bfloat16", "int16"),
    "quantised, int8 activations": ("gguf", "bfloat16", "int8"),
}


@dataclass
class Fidelity:
    model: str
    path: str
    rows: int
    perplexity: float
    kl_mean: float
    kl_p99: float
    top1_agreement: float


@dataclass
class GreedyAgreement:
    model: str
    path: str
    batched: bool  # the prompts in one generate call (as the test runs them), or one at a time
    tokens_agreeing_with_bf16: list[int]
    tokens_agreeing_with_float32: list[int]


def make_engine(model: str, path: str, num_tokens: int) -> LLM:
    # Every layer's KV in one page table (window_pages off): log_probs below writes the text's blocks itself.
    quantization, dtype, activations = PATHS[path]
    return LLM(model=model, quantization=quantization, dtype=dtype, quantized_activations=activations,
               block_size=BLOCK_SIZE, num_kv_blocks=math.ceil(num_tokens / BLOCK_SIZE) + 64,
               max_num_batched_tokens=max(num_tokens, 4096), enable_prefix_caching=False, window_pages=False)


def log_probs(llm: LLM, ids: list[int], rows: int) -> Iterator[torch.Tensor]:
    """Each position's log-probabilities over the vocabulary, ``rows`` positions per forward, in order. The
    engine is idle and has no prefix cache: its first blocks are this text's."""
    engine = llm.engine
    model = engine.model
    blocks = list(range(math.ceil(len(ids) / BLOCK_SIZE)))
    with torch.no_grad(), model.thread_scope:
        for start in range(0, len(ids), rows):
            end = min(start + rows, len(ids))
            step = StepRows(BLOCK_SIZE, torch.arange(start, end),
                            prefills=[PrefillChunk(0, end - start, end, blocks[:math.ceil(end / BLOCK_SIZE)])],
                            written_block_ids=blocks[start // BLOCK_SIZE:math.ceil(end / BLOCK_SIZE)])
            meta = engine.backend.build_metadata(step)
            hidden = model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), meta,
                                   engine.runner.kv_caches)
            for part in hidden.split(REFERENCE_ROWS):  # [rows, vocab] at a time: the vocabulary is wide
                yield torch.log_softmax(model.compute_logits(part).float(), dim=-1)


def fidelity(model: str, path: str, llm: LLM, ids: list[int], rows: int, reference: torch.Tensor) -> Fidelity:
    kls, top1, nll, done = [], 0, 0.0, 0
    targets = torch.tensor(ids)
    for lp in log_probs(llm, ids, rows):
        ref = reference[done:done + lp.shape[0]]
        kls.append((ref.exp() * (ref - lp)).sum(dim=-1))
        top1 += int((lp.argmax(dim=-1) == ref.argmax(dim=-1)).sum())
        scored = min(lp.shape[0], len(ids) - 1 - done)  # the last position has no next token
        nll -= float(lp[:scored].gather(1, targets[done + 1:done + 1 + scored, None]).sum())
        done += lp.shape[0]
    kl = torch.cat(kls)
    return Fidelity(model, path, rows, math.exp(nll / (len(ids) - 1)), float(kl.mean()), float(kl.quantile(0.99)),
                    top1 / len(ids))


def greedy(llm: LLM, prompts: list[str]) -> dict[bool, list[list[int]]]:
    """The prompts' greedy tokens, batched in one call and one prompt at a time: a batch's decode steps are
    wider, and the quantised kernels' activations depend on the width."""
    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    alone = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
    return {True: batched, False: alone}


def tokens_agreeing(outputs: list[list[int]], reference: list[list[int]]) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), AGREEMENT_TOKENS)
            for o, r in zip(outputs, reference, strict=True)]


def measure(model: str, num_tokens: int, widths: list[int]) -> tuple[list[Fidelity], list[GreedyAgreement]]:
    prompts = json.loads((DATA / "agreement_prompts.json").read_text())
    reference_llm = make_engine(model, "float32 dequantised", num_tokens)
    ids = reference_llm.engine.tokenizer.encode((DATA / "perplexity.txt").read_text())[:num_tokens]
    reference = torch.cat(list(log_probs(reference_llm, ids, REFERENCE_ROWS)))
    greedy_float32 = greedy(reference_llm, prompts)
    reference_llm.close()
    del reference_llm
    nll = -float(reference[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean())
    print(f"{model:20} {'float32 dequantised':28} perplexity {math.exp(nll):8.4f} (the reference)", flush=True)
    fidelities, agreements = [], []
    greedy_bf16: dict[bool, list[list[int]]] = {}
    for path in list(PATHS)[1:]:
        llm = make_engine(model, path, num_tokens)
        if PATHS[path][2] == "int8" and "int8 activations" not in llm.engine.backend.description:
            print(f"{model}: {path}: skipped, this build has no interleaved kernels (int8 falls back to int16)")
            llm.close()
            continue
        for rows in widths:
            row = fidelity(model, path, llm, ids, rows, reference)
            fidelities.append(row)
            print(f"{model:20} {path:28} rows {rows:5}  perplexity {row.perplexity:8.4f}  KL mean {row.kl_mean:.5f}"
                  f"  p99 {row.kl_p99:.4f}  top-1 {row.top1_agreement:.4f}", flush=True)
        outputs = greedy(llm, prompts)
        greedy_bf16 = greedy_bf16 or outputs  # the first path's
        for batched in (True, False):
            agreement = GreedyAgreement(model, path, batched, tokens_agreeing(outputs[batched], greedy_bf16[batched]),
                                        tokens_agreeing(outputs[batched], greedy_float32[batched]))
            agreements.append(agreement)
            full = [sum(n == AGREEMENT_TOKENS for n in a)
                    for a in (agreement.tokens_agreeing_with_bf16, agreement.tokens_agreeing_with_float32)]
            print(f"{model:20} {path:28} greedy {'batched' if batched else 'alone':7}, prompts agreeing all "
                  f"{AGREEMENT_TOKENS} tokens: with bf16 dequantised {full[0]} of {len(prompts)}, with float32 "
                  f"dequantised {full[1]} of {len(prompts)}", flush=True)
        llm.close()
        del llm
    return fidelities, agreements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score")
    parser.add_argument("--rows", default="2048,16,1", help="tokens per forward, one pass per value")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args()
    widths = [int(w) for w in args.rows.split(",")]
    results: dict[str, list] = {"fidelity": [], "greedy": []}
    for model in args.models.split(","):
        fidelities, agreements = measure(model, args.tokens, widths)
        results["fidelity"] += [asdict(f) for f in fidelities]
        results["greedy"] += [asdict(a) for a in agreements]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
