"""The engine step loop: the only joint of scheduler and runner (the offline ``LLM`` API is kvserve/offline.py).

One step::

    out = scheduler.schedule()                  what runs, and the KV transfers to and from the tiers
    result = runner.execute(out)                the forward, sampling and speculative verification
    step = output_processor.process(scheduler.update(out, result))    tokens in; text, stop strings out
    scheduler.finish_requests(step.updates)     every request that ends, ends here

Requests come in through the input processor, which validates and tokenises them on the caller's side.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvserve.block_hash import salted_hash_extra
from kvserve.cache.draft_kv import DraftKVCache
from kvserve.cache.kv_events import KVEventLog
from kvserve.cache.kv_manager import KVCacheManager
from kvserve.cache.tiers import TieredKVStore
from kvserve.config import ArchConfig, BackendConfig, EngineConfig, SpeculativeConfig, StorageConfig
from kvserve.errors import ConfigError, EngineDeadError, InvalidRequest, ModelNotFound
from kvserve.input_processor import InputProcessor, PromptType
from kvserve.kv_layout import KVLayout
from kvserve.model.backends.base import Backend
from kvserve.model.backends.select import select_backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import iter_weights, model_fingerprint, read_arch_config, resolve_model_path
from kvserve.model.lora import LoRAAdapter, load_adapter
from kvserve.model.quantized import REQUANTIZE_TYPES
from kvserve.model.registry import build_model
from kvserve.model_store.catalog import int8_activations_for
from kvserve.model_store.token_map import TokenMap
from kvserve.output_processor import OutputProcessor
from kvserve.reasoning import Phase, ReasoningTokens, constrained_phase, markers_for
from kvserve.request import ProcessedPrompt, Request, RequestOutput
from kvserve.runner.device import resolve_device, resolve_dtype
from kvserve.runner.draft_lengths import DraftLengthPolicy
from kvserve.runner.draft_model import DraftModelProposer
from kvserve.runner.draft_vocab import kept_ids
from kvserve.runner.kv_memory import allocate_kv_caches, num_blocks_for
from kvserve.runner.kv_transfer import block_nbytes, block_shape
from kvserve.runner.model_runner import ModelRunner
from kvserve.runner.sampler import Sampler
from kvserve.runner.speculative import NgramProposer, Proposer
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from kvserve.storage.base import KeyNamespace, TierStats
from kvserve.structured.grammar import GrammarCompiler, GrammarStats
from kvserve.structured.masks import GrammarMasker
from kvserve.tokenizer import Tokenizer, read_chat_template, tokenizer_mismatch

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineAudit", "EngineStats", "PromptType"]


@dataclass(frozen=True, slots=True)
class EngineAudit:
    """The block accounting checked (``Engine.audit``). Idle, every count must be 0: a block still used or a
    prefix-cache node still locked with no request left is a leak."""

    ok: bool
    error: str | None
    num_unfinished: int
    num_used_blocks: int
    num_locked_nodes: int


@dataclass(slots=True)
class EngineStats:
    """Engine-wide counters, read by the server's /metrics and by benchmarks."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    num_evicted_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_steps: int
    busy_time_s: float
    # Prompt tokens found cached at admission, by where they came from: "device" and each lower tier.
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # Per lower tier (host, disk, redis): that store's counters, with hits/misses in tokens at admission.
    tiers: dict[str, TierStats] = field(default_factory=dict)
    tiers_healthy: dict[str, bool] = field(default_factory=dict)
    # Speculative decoding: the method, decodes that verified drafts, drafts verified and of those accepted,
    # drafts proposed (the scheduler may cut them), the time proposing took (a draft model's forwards), and
    # the mean number of drafts the last step chose per request.
    spec_method: str = "none"
    num_draft_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_proposed_draft_tokens: int = 0
    # Of the drafts verified, those prompt lookup found (n-gram's all; a draft model's with prompt_lookup).
    num_lookup_draft_tokens: int = 0
    num_lookup_accepted_tokens: int = 0
    draft_time_s: float = 0.0
    draft_length: float = 0.0
    grammar: GrammarStats = field(default_factory=GrammarStats)  # structured output: compiles and cache
    num_constrained_tokens: int = 0  # tokens sampled under a grammar's mask, and the time the masks took
    grammar_mask_time_s: float = 0.0
    num_prefilling: int = 0  # of the running requests, those with prompt tokens still to compute


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.model_path = resolve_model_path(mc.model, pull=mc.pull, show_progress=mc.show_progress)
        self.arch: ArchConfig = read_arch_config(self.model_path)
        if mc.max_model_len is not None and mc.max_model_len > self.arch.max_position_embeddings:
            longrope = self.arch.rope_scaling is not None and self.arch.rope_scaling.kind == "longrope"
            raise InvalidRequest(f"max_model_len {mc.max_model_len} exceeds the model's context length "
                                 f"{self.arch.max_position_embeddings}" + (
                                     " (LongRoPE is served within its original context: its long factors, for "
                                     "longer contexts, are not run)" if longrope else ""), "max_model_len")
        self.fingerprint = model_fingerprint(self.model_path)
        self.tokenizer = Tokenizer.from_model_path(self.model_path)
        if mc.chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(read_chat_template(mc.chat_template))
        # A reasoning model's markers (None: its outputs have no thoughts apart from the answer).
        self.reasoning_markers = markers_for(mc.reasoning_parser, self.tokenizer.chat_template)
        self.reasoning_tokens = ReasoningTokens.of(self.reasoning_markers, self.tokenizer)

        self.backend, self.model = self._load_model(self.model_path, self.fingerprint, self.arch)
        # LoRA adapters by the name requests give them (lora_name), loaded now or later (add_lora).
        self.loras: dict[str, LoRAAdapter] = {}
        for name, path in mc.lora_adapters():
            self.add_lora(name, path)

        cc = config.cache
        num_blocks = num_blocks_for(self.arch, cc, self.dtype)
        self.kv_layout = self._kv_layout()
        num_pages = self.kv_layout.num_pages(num_blocks)
        self.max_model_len = self._resolve_max_model_len(
            self.kv_layout.max_tokens(num_pages, cc.block_size, config.scheduler.max_num_batched_tokens))
        kv_caches = allocate_kv_caches(self.arch, num_pages, cc.block_size, self.dtype, self.device, self.kv_layout)
        self.model.prepare_decode(kv_caches, self.kv_layout.layer_group)
        self.tiers = self._build_tiers(config.storage, kv_caches)
        # The device prefix cache's blocks as events a gateway follows (GET /kvserve/kv_events).
        self.kv_events = KVEventLog() if cc.enable_prefix_caching else None
        self.kv_manager = KVCacheManager(num_pages, cc.block_size, cc.enable_prefix_caching, self.tiers,
                                         keep_tails=cc.keep_tails, events=self.kv_events, layout=self.kv_layout)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, config.structured)
        sampler = Sampler(self.arch.vocab_size, mc.seed, argmax=self.backend.argmax,
                          grammar_masker=GrammarMasker(self.grammars.mask_vocab_size, self.backend.mask_logits))
        spec = config.speculative
        self.draft_kv: DraftKVCache | None = None
        proposer: Proposer | None = None
        if spec.method == "ngram":
            proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "draft_model":
            proposer = self._build_draft_proposer(spec, num_blocks)
        draft_lengths = DraftLengthPolicy(spec.num_speculative_tokens, adaptive=spec.adaptive,
                                          uses_model=spec.method == "draft_model")
        if isinstance(proposer, DraftModelProposer) and spec.adaptive:
            # The draft's costs measured now, so that no live request's prefill in the draft measures them.
            timings = proposer.measure_forwards()
            draft_lengths.observe_draft(timings)
            if timings:  # the last pass: the prefill chunk, then each row count
                logger.info("draft forwards measured: %s", ", ".join(
                    f"{rows} rows {seconds * 1e3:.1f} ms" for rows, seconds in timings[-len(timings) // 2:]))
        self.runner = ModelRunner(self.model, self.backend, kv_caches, cc.block_size, sampler, proposer=proposer,
                                  propose_below_batch_size=spec.disable_by_batch_size, draft_lengths=draft_lengths,
                                  reasoning=self.reasoning_tokens)
        # Block hashes carry the model fingerprint, so cached KV can never be matched across models.
        self.block_hash_extra = f"{self.fingerprint}:{cc.hash_salt}".encode()  # public: gateways hash blocks too
        self.eos_token_ids = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + self.arch.eos_token_ids))
        self.input_processor = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                              self.grammars, self.eos_token_ids,
                                              priority_scheduling=config.scheduler.policy == "priority")
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # True from a step's start to its end: a step that raised (or still runs on another thread) may have
        # cached blocks whose KV it never computed (blocks are cached as they are scheduled).
        self._step_unfinished = False

    def _kv_layout(self) -> KVLayout:
        """Window layers in KV groups of their own (their pages freed past the window), unless turned off or
        the tiers are on: they store whole blocks of every layer."""
        layout = KVLayout.for_arch(self.arch)
        if not layout.is_grouped or not self.config.cache.window_pages:
            return KVLayout.single(self.arch.num_layers)
        if self.config.storage.enabled:
            logger.warning("KV tiers are on: the sliding-window layers keep every block (their pages are freed "
                           "past the window only without tiers)")
            return KVLayout.single(self.arch.num_layers)
        logger.info("KV pages: %d groups of %d layers, %d of them sliding-window (window %d): their pages are "
                    "freed once every query is past them", layout.num_groups, layout.layers_per_page,
                    sum(layout.windowed), layout.window)
        return layout

    def _load_model(self, path: Path, fingerprint: str, arch: ArchConfig, quantization: str | None = None
                    ) -> tuple[Backend, LlamaForCausalLM]:
        """A model's backend and weights, as the model options say (the draft model is loaded the same way,
        with its own ``quantization`` if it has one: "q4_0" requantises its wider matrices to Q4_0)."""
        mc = self.config.model
        quantization = quantization or mc.quantization
        t0 = time.perf_counter()
        int8 = int8_activations_for(mc.quantized_activations, fingerprint)
        backend = select_backend(self.device, self.dtype, arch, mc.cpu_kernels, self._backend_config(),
                                 int8_activations=int8)
        model = build_model(arch, self.dtype, self.device, backend)
        keep_blocks = (quantization == "gguf" or quantization in REQUANTIZE_TYPES
                       or (quantization == "auto" and backend.quantized_by_default))
        quantized_types = backend.quantized_types if keep_blocks else frozenset()
        requantize_to = REQUANTIZE_TYPES.get(quantization)
        if requantize_to is not None and path.is_dir():
            raise ConfigError(f"speculative_config.quantization: {quantization!r} quantises a GGUF file's blocks "
                              f"again; the draft {path.name} is a directory of dense weights", "quantization")
        if requantize_to is not None and requantize_to not in quantized_types:
            raise ConfigError(f"speculative_config.quantization: {quantization!r} needs a backend that runs those "
                              f"blocks; {backend.name} has no kernels for them", "quantization")
        model.load_weights(iter_weights(path, arch, self.dtype, show_progress=mc.show_progress,
                                        quantized_types=quantized_types,
                                        interleave_quantized=backend.quantized_interleaved,
                                        requantize_to=requantize_to))
        logger.info("loaded %s (%s) in %.1fs; weights: %s", path.name, arch.architecture, time.perf_counter() - t0,
                    model.weight_summary())
        if int8 and mc.quantized_activations == "auto" and model.holds_quantized_weights:
            if backend.quantized_int8_activations:
                logger.info("quantised activations: int8 for %s, a known model whose quality with them is checked "
                            "(--quantized-activations int16 keeps them as exact as bf16)", path.name)
            else:
                logger.info("quantised activations: int16 for %s (its default is int8, whose kernels this CPU "
                            "lacks: they need AVX512-VNNI)", path.name)
        return backend, model

    def _backend_config(self) -> BackendConfig:
        """The backend options, CUDA graphs captured no wider than a decode step can be: every running
        request with its most drafts."""
        config = self.config
        spec = config.speculative
        rows_per_request = 1 + (spec.num_speculative_tokens if spec.method != "none" else 0)
        widest = config.scheduler.max_num_seqs * rows_per_request
        return replace(config.backend, cuda_graph_max_rows=min(config.backend.cuda_graph_max_rows, widest))

    def _build_draft_proposer(self, spec: SpeculativeConfig, target_blocks: int) -> DraftModelProposer:
        """The draft model on its own KV pool, after checking it can draft for this target: the same
        tokenizer (vocabulary and special tokens) and fewer parameters."""
        assert spec.model is not None
        try:
            path = resolve_model_path(spec.model, pull=self.config.model.pull,
                                      show_progress=self.config.model.show_progress)
        except ModelNotFound as exc:
            raise ConfigError(f"speculative_config.model: the draft model was not found: {exc}", "model") from None
        arch = read_arch_config(path)
        why = tokenizer_mismatch(self.tokenizer, Tokenizer.from_model_path(path))
        if why is not None:
            raise ConfigError(f"speculative_config.model: the draft {path.name} cannot draft for "
                              f"{self.model_path.name}: {why}", "model")
        vocab_size = min(arch.vocab_size, self.arch.vocab_size)
        kept = self._draft_kept_ids(spec, vocab_size)  # a bad token map is refused before the draft loads
        fingerprint = model_fingerprint(path)
        backend, model = self._load_model(path, fingerprint, arch, spec.quantization)
        if model.num_parameters > self.model.num_parameters:
            raise ConfigError(f"speculative_config.model: the draft {path.name} has {model.num_parameters:,} "
                              f"parameters, more than the target's {self.model.num_parameters:,}", "model")
        cc = self.config.cache
        # As many tokens as the target's pool, and room for every running request's drafts on top.
        num_blocks = target_blocks + self.config.scheduler.max_num_seqs * (
            -(-spec.num_speculative_tokens // cc.block_size) + 1)
        kv_caches = allocate_kv_caches(arch, num_blocks, cc.block_size, self.dtype, self.device)
        model.prepare_decode(kv_caches, KVLayout.single(arch.num_layers).layer_group)
        draft_kv = DraftKVCache(num_blocks, cc.block_size, f"{fingerprint}:{cc.hash_salt}".encode(),
                                enable_prefix_caching=cc.enable_prefix_caching)
        logger.info("draft model %s: %d KV blocks, up to %d drafts a step%s%s%s", path.name, num_blocks,
                    spec.num_speculative_tokens, " (adaptive)" if spec.adaptive else "",
                    "" if kept is None else (f", drafts among {len(kept):,} token ids"
                                             + (" of the token map" if spec.draft_token_map else "")
                                             + " and each request's prompt"),
                    ", prompt lookup first" if spec.prompt_lookup else "")
        self.draft_kv = draft_kv
        return DraftModelProposer(model, backend, kv_caches, cc.block_size, draft_kv,
                                  max_model_len=min(arch.max_position_embeddings, self.max_model_len),
                                  vocab_size=vocab_size, seed=self.config.model.seed, kept_ids=kept,
                                  lookup=(NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                        spec.prompt_lookup_max) if spec.prompt_lookup else None))

    def _draft_kept_ids(self, spec: SpeculativeConfig, vocab_size: int) -> list[int] | None:
        """The ids a pruned draft proposes from besides each request's prompt (None: all): the token map's
        leading ones (and the special tokens), or the ids below ``draft_vocab_size``."""
        ranked = None
        if spec.draft_token_map is not None:
            token_map = TokenMap.read(spec.draft_token_map)
            token_map.check_vocabulary(self.tokenizer)
            ranked = token_map.token_ids
        return kept_ids(vocab_size, spec.draft_vocab_size, ranked, always=sorted(self.tokenizer.all_special_ids))

    def _build_tiers(self, storage: StorageConfig, kv_caches: list[torch.Tensor]) -> TieredKVStore | None:
        """The host / disk / Redis tiers below device memory, keyed for this model, how it is computed (dtype,
        weights in their blocks or not, activation code) and block size."""
        if not storage.enabled:
            return None
        dtype_name = str(self.dtype).removeprefix("torch.")
        namespace = KeyNamespace(self.fingerprint, dtype_name, self.config.cache.block_size,
                                 numerics=self._kv_numerics())
        tiers = TieredKVStore(storage, namespace, block_shape(kv_caches), payload_nbytes=block_nbytes(kv_caches))
        logger.info("KV tiers below device memory: %s (%s, retention %.0f s)", ", ".join(tiers.names) or "none",
                    storage.write_policy, storage.retention_s)
        return tiers

    @property
    def shared_kv_group(self) -> str | None:
        """Which engines read the KV this one leaves in a shared tier: those on the same Redis whose tier keys
        have the same namespace (model, dtype, numerics, block size) are of one group. None without one."""
        redis_url = self.config.storage.redis_url
        if redis_url is None or self.tiers is None:
            return None
        return hashlib.blake2b(redis_url.encode() + self.tiers.namespace.digest(), digest_size=8).hexdigest()

    def _kv_numerics(self) -> str:
        """How the weights are multiplied, as far as it changes the KV beside the dtype: each way is an
        approximation of the model of its own, and an engine reads only the KV of its own kind."""
        if not self.model.holds_quantized_weights:
            return "dense"
        return "gguf-int8" if self.backend.quantized_int8_activations else "gguf"

    def _resolve_max_model_len(self, pool_tokens: int) -> int:
        model_len = self.arch.max_position_embeddings
        wanted = self.config.model.max_model_len  # at most model_len: checked before the weights loaded
        limit = min(wanted or model_len, pool_tokens)
        if limit < (wanted or model_len):
            logger.warning("max_model_len capped at %d tokens: the KV pool holds no more", limit)
        return limit

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Validate and queue one request (n == 1; callers fan out n > 1). Raises typed errors."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequest("Engine.add_request takes n == 1; use LLM.generate or the server for n > 1", "n")
        return self.add_processed(self.input_processor.process(prompt, params), request_id)

    def add_processed(self, processed: ProcessedPrompt, request_id: str | None = None) -> Request:
        """Queue a prompt the input processor has validated and tokenised (n == 1)."""
        token_ids, params = processed.prompt_token_ids, processed.sampling_params
        tokens = self.reasoning_tokens
        if params.thinking_token_budget is not None and tokens is None:
            raise InvalidRequest("thinking_token_budget needs a reasoning model: this one's chat template writes no "
                                 "<think> block (see --reasoning-parser)", "thinking_token_budget")
        if tokens is not None and (params.thinking_token_budget is not None or params.structured_outputs is not None):
            # what the runner's gate starts from, read once here (not again on each return from a preemption): the
            # chat route's reading of the generation prompt, else the prompt's last markers
            phase = Phase(params.reasoning_phase) if params.reasoning_phase else tokens.phase_after_prompt(token_ids)
            phase = constrained_phase(phase, tokens, params.structured_outputs is not None)
            params = replace(params, reasoning_phase=phase.value)
        max_total = self.max_model_len if params.max_tokens is None else len(token_ids) + params.max_tokens
        grammar = processed.grammar
        if grammar is None and params.structured_outputs is not None:
            # A caller that compiled it apart and handed nothing over: found in the compiler's cache.
            grammar = self.grammars.compile(params.structured_outputs, count_hit=False)
        order = next(self._ids)
        lora = self.lora(params.lora_name)
        hash_extra = salted_hash_extra(self.block_hash_extra, params.cache_salt, lora.cache_key if lora else b"")
        request = Request(
            request_id if request_id is not None else f"req-{order}",
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=max_total,
            arrival_order=order,
            hash_extra=hash_extra,
            prompt=processed.prompt,
            grammar=grammar,
            lora=lora,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        return request

    # --- LoRA adapters ----------------------------------------------------------------------------------------
    def add_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load a PEFT LoRA adapter from ``path`` for requests whose ``lora_name`` is ``name`` (LoRALoadError
        if it does not fit the model; an adapter already under that name is replaced for new requests)."""
        adapter = load_adapter(name, path, self.arch, self.dtype, self.device)
        self.loras[name] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, adapter.path, adapter.rank)
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Unload adapter ``name`` for new requests (running ones finish with it); False if none is loaded."""
        return self.loras.pop(name, None) is not None

    def lora(self, name: str | None) -> LoRAAdapter | None:
        """The adapter loaded under ``name`` (None: the base model); ModelNotFound if none is."""
        if name is None:
            return None
        adapter = self.loras.get(name)
        if adapter is None:
            error = ModelNotFound(f"no LoRA adapter '{name}' is loaded" + (
                f"; loaded: {', '.join(sorted(self.loras))}" if self.loras else ""))
            error.param = "model"  # type: ignore[attr-defined]
            raise error
        return adapter

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        return self.output_processor.abort(request) if request is not None else None

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.unfinished_request_ids()

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or KV still to copy out for the tiers (the next step does it)."""
        return self.scheduler.has_unfinished() or self.kv_manager.has_pending_transfers

    # --- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._step_unfinished:  # the runner, the scheduler and the cache no longer agree on what was run
            raise EngineDeadError("the engine's last step did not finish (it raised or was interrupted): its "
                                  "state is no longer consistent; close it and make a new one")
        self._step_unfinished = True
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        step = self.output_processor.process(self.scheduler.update(out, result))
        self.scheduler.finish_requests(step.updates)
        self._step_unfinished = False
        return step.outputs

    def wait_for_tier_writes(self) -> None:
        """Block until the KV queued for disk and Redis is written (offline callers; tests)."""
        self.kv_manager.wait_for_tier_writes()

    def close(self, persist: bool = True) -> None:
        """Persist cached KV to the tiers that outlive the process (disk, Redis), then release the tiers,
        so a restarted server finds today's prefixes even under the write_back policy. Not after a step that
        did not finish (an error, an interrupt), nor with ``persist`` false (the engine's thread did not stop
        and may still change the cache): it may then hold blocks whose KV was never computed, which would be
        served to the next engine as valid."""
        persist = persist and not self._step_unfinished
        if not persist:
            logger.warning("the engine did not stop cleanly: the device's cached KV is not persisted to the tiers")
        self.kv_manager.close(self.runner.read_blocks if persist else None)
        self.grammars.close()

    # --- observability ----------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.kv_manager
        masker = self.runner.sampler.grammar_masker
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prefilling=self.scheduler.num_prefilling,
            num_kv_blocks=kv.num_blocks,
            num_used_blocks=kv.pool.num_used,
            num_cached_blocks=kv.num_cached_blocks,
            num_free_blocks=kv.pool.num_free,
            num_evicted_blocks=kv.num_evicted_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            spec_method=self.config.speculative.method,
            num_draft_steps=self.scheduler.num_draft_steps,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_proposed_draft_tokens=self.runner.num_proposed_tokens,
            num_lookup_draft_tokens=self.runner.num_lookup_draft_tokens,
            num_lookup_accepted_tokens=self.runner.num_lookup_accepted_tokens,
            draft_time_s=self.runner.propose_time_s,
            draft_length=self.runner.draft_lengths.last_mean_length,
            num_accepted_draft_tokens=self.scheduler.num_accepted_draft_tokens,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            num_generated_tokens=self.output_processor.num_generated_tokens,
            num_steps=self.runner.num_steps,
            busy_time_s=self.runner.busy_time_s,
            cached_tokens_by_tier=dict(kv.stats.hits_by_tier),
            tiers=kv.tiers.stats(),
            tiers_healthy=kv.tiers.healthy(),
            grammar=replace(self.grammars.stats),
            num_constrained_tokens=masker.num_masked_rows if masker else 0,
            grammar_mask_time_s=masker.mask_time_s if masker else 0.0,
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        if self.draft_kv is not None:
            self.draft_kv.check_invariants()

    def audit(self) -> EngineAudit:
        """``check_invariants`` as a report instead of an exception, with what must be zero when idle."""
        try:
            self.check_invariants()
            error = None
        except AssertionError as exc:
            error = str(exc) or "an invariant does not hold"
        kv = self.kv_manager
        return EngineAudit(ok=error is None, error=error, num_unfinished=len(self.unfinished_request_ids()),
                           num_used_blocks=kv.pool.num_used, num_locked_nodes=kv.prefix_cache.num_locked_nodes())
