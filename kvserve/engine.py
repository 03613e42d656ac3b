"""The engine step loop (the only joint of scheduler and runner) and the offline ``LLM`` API.

One step:  out = scheduler.schedule();  result = runner.execute(out);  scheduler.update(out, result);
then detokenise the new tokens, apply stop strings, and hand back a RequestOutput per updated request.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvserve.batch import SchedulerOutput
from kvserve.cache.kv_manager import KVCacheManager
from kvserve.cache.tiers import TieredKVStore
from kvserve.config import (
    ArchConfig,
    EngineConfig,
    SpeculativeConfig,
    StorageConfig,
    speculative_config_from_dict,
)
from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.errors import ContextLengthExceeded, EmptyPrompt, InvalidRequest, InvalidSamplingParams
from kvserve.model.backends.select import select_backend
from kvserve.model.loader import iter_weights, model_fingerprint, read_arch_config, resolve_model_path
from kvserve.model.registry import build_model
from kvserve.request import CompletionOutput, FinishReason, Request, RequestOutput, SamplingParams
from kvserve.runner.device import resolve_device, resolve_dtype
from kvserve.runner.kv_memory import allocate_kv_caches, num_blocks_for
from kvserve.runner.kv_transfer import block_nbytes, block_shape
from kvserve.runner.model_runner import ModelRunner
from kvserve.runner.sampler import Sampler
from kvserve.runner.speculative import NgramProposer
from kvserve.scheduler import Scheduler
from kvserve.storage.base import KeyNamespace, TierStats
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


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
    num_draft_tokens: int = 0  # speculative tokens verified, and of those accepted
    num_accepted_draft_tokens: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.model_path = resolve_model_path(mc.model)
        self.arch: ArchConfig = read_arch_config(self.model_path)
        self.fingerprint = model_fingerprint(self.model_path)
        self.tokenizer = Tokenizer.from_model_path(self.model_path)

        t0 = time.perf_counter()
        self.backend = select_backend(self.device, self.dtype, self.arch, mc.cpu_kernels, config.backend)
        self.model = build_model(self.arch, self.dtype, self.device, self.backend)
        self.model.load_weights(iter_weights(self.model_path, self.arch, self.dtype, show_progress=mc.show_progress))
        logger.info("loaded %s (%s) in %.1fs", self.model_path.name, self.arch.architecture, time.perf_counter() - t0)

        cc = config.cache
        num_blocks = num_blocks_for(self.arch, cc, self.dtype)
        self.max_model_len = self._resolve_max_model_len(num_blocks * cc.block_size)
        kv_caches = allocate_kv_caches(self.arch, num_blocks, cc.block_size, self.dtype, self.device)
        self.tiers = self._build_tiers(config.storage, kv_caches)
        self.kv_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, self.tiers)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        sampler = Sampler(self.arch.vocab_size, mc.seed, argmax=self.backend.argmax)
        spec = config.speculative
        proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
                    if spec.enabled else None)
        self.runner = ModelRunner(self.model, self.backend, kv_caches, cc.block_size, sampler, proposer=proposer,
                                  propose_below_batch_size=spec.disable_by_batch_size)
        # Block hashes carry the model fingerprint, so cached KV can never be matched across models.
        self._hash_extra = f"{self.fingerprint}:{cc.hash_salt}".encode()
        self.eos_token_ids = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + self.arch.eos_token_ids))
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._num_prompt_tokens_computed = 0
        self._num_generated_tokens = 0
        self._num_steps = 0
        self._busy_time = 0.0
        self._next_sweep = time.monotonic() + (self.tiers.sweep_interval_s if self.tiers else 0.0)

    def _build_tiers(self, storage: StorageConfig, kv_caches: list[torch.Tensor]) -> TieredKVStore | None:
        """The host / disk / Redis tiers below device memory, keyed for this model, dtype and block size."""
        if not storage.enabled:
            return None
        if not self.config.cache.enable_prefix_caching:
            logger.warning("KV storage tiers need the prefix cache: they stay off (--no-enable-prefix-caching)")
            return None
        dtype_name = str(self.dtype).removeprefix("torch.")
        namespace = KeyNamespace(self.fingerprint, dtype_name, self.config.cache.block_size)
        tiers = TieredKVStore(storage, namespace, block_shape(kv_caches), payload_nbytes=block_nbytes(kv_caches))
        logger.info("KV tiers below device memory: %s (%s, retention %.0f s)", ", ".join(tiers.names) or "none",
                    storage.write_policy, storage.retention_s)
        return tiers

    def _resolve_max_model_len(self, pool_tokens: int) -> int:
        model_len = self.arch.max_position_embeddings
        wanted = self.config.model.max_model_len
        if wanted is not None and wanted > model_len:
            raise InvalidRequest(
                f"max_model_len {wanted} exceeds the model's context length {model_len}", "max_model_len"
            )
        limit = min(wanted or model_len, pool_tokens)
        if limit < (wanted or model_len):
            logger.warning("max_model_len capped at %d tokens: the KV pool holds no more", limit)
        return limit

    # --- requests -------------------------------------------------------------------------------------------
    def check_text_fits(self, text: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context however it tokenizes: megabytes
        of prompt took seconds to tokenize only to be refused. The factor 4 leaves room for normalizers
        that compose characters (NFC) before the tokens are cut."""
        limit = self.max_model_len
        most = 4 * limit * self.tokenizer.max_token_chars
        if len(text) > most:
            raise ContextLengthExceeded(
                f"the prompt has {len(text)} characters; this model's maximum context length is {limit} tokens, "
                f"and no more than {most} characters can fit in them"
            )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPrompt()
            self.check_text_fits(prompt)
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        else:
            token_ids = prompt
        token_ids = list(token_ids)
        if not token_ids:
            raise EmptyPrompt()
        vocab = self.arch.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        return token_ids, None

    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Validate and queue one request (n == 1; callers fan out n > 1). Raises typed errors."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequest("Engine.add_request takes n == 1; use LLM.generate or the server for n > 1", "n")
        self.check_params(params)
        token_ids, text = self.tokenize_prompt(prompt)
        self.check_context(len(token_ids), params.max_tokens)
        max_total = self.max_model_len if params.max_tokens is None else len(token_ids) + params.max_tokens
        order = next(self._ids)
        request = Request(
            request_id if request_id is not None else f"req-{order}",
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=max_total,
            arrival_order=order,
            hash_extra=self._hash_extra,
            prompt=text,
        )
        self.scheduler.add_request(request)
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        return request

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check on its own: token ids against this model's vocabulary."""
        vocab = self.arch.vocab_size
        outside = [token for token, _ in params.logit_bias if token >= vocab]
        if outside:
            raise InvalidSamplingParams(f"logit_bias token ids must be < {vocab} (the vocabulary size), got "
                                        f"{outside[0]}", param="logit_bias")

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt_tokens} tokens but this model's maximum context length is {limit} "
                f"tokens, which must also fit at least one generated token"
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {limit} tokens; the prompt has {num_prompt_tokens} "
                f"tokens and max_tokens asks for {max_tokens} more ({num_prompt_tokens + max_tokens} in total)",
                param="max_tokens",
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        if self.tiers is not None:
            self._tier_upkeep()
        # Text held back for a possible stop string is final now: send it, so the streamed deltas add up
        # to the output's text, as they do for every other way a request ends.
        return self._make_output(request, [], self._detokenizers[request.request_id].flush())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            if out.kv_offloads:
                self._transfer_only(out)
            # Only requests whose prefix is still being read from disk or Redis: wait for it, don't spin.
            self.kv_manager.wait_for_fetches(timeout_s=0.01)
            return []
        t0 = time.perf_counter()
        result = self.runner.execute(out)
        self._busy_time += time.perf_counter() - t0
        self._num_steps += 1
        if result.offloaded:
            self.kv_manager.store_offloaded(result.offloaded)
        updated = self.scheduler.update(out, result)
        for scheduled in out.scheduled:
            request = self.scheduler.requests.get(scheduled.request_id)
            prompt_left = (request.num_prompt_tokens if request else 0) - scheduled.start_position
            self._num_prompt_tokens_computed += max(0, min(len(scheduled.token_ids), prompt_left))
        outputs = [self._process_new_tokens(request, num_new) for request, num_new in updated]
        self._num_generated_tokens += sum(len(output.delta_token_ids) for output in outputs)
        if self.tiers is not None:
            self._tier_upkeep()  # after stop strings: they finish requests too
        return outputs

    def _tier_upkeep(self) -> None:
        """After a step: with nothing left to run, copy out what is queued for the tiers now (write_through
        queues blocks as they fill; they would otherwise wait for the next request); now and then, drop
        expired entries."""
        if self.kv_manager.has_pending_transfers and not self.scheduler.has_unfinished():
            loads, offloads = self.kv_manager.take_transfers()
            assert not loads, "loads are only queued by an admission"
            self._transfer_only(SchedulerOutput(kv_offloads=offloads))
        now = time.monotonic()
        if now >= self._next_sweep:
            assert self.tiers is not None
            self.tiers.sweep()
            self._next_sweep = now + self.tiers.sweep_interval_s

    def _transfer_only(self, out: SchedulerOutput) -> None:
        result = self.runner.execute(out)
        self.kv_manager.store_offloaded(result.offloaded)

    def close(self) -> None:
        """Persist cached KV to the tiers that outlive the process (disk, Redis), then release the tiers,
        so a restarted server finds today's prefixes even under the write_back policy."""
        if self.tiers is None:
            return
        t0 = time.perf_counter()
        blocks = self.kv_manager.blocks_to_persist()
        payloads = self.runner.read_blocks([block_id for block_id, _ in blocks]) if blocks else []
        self.tiers.persist([(block_hash, payload) for (_, block_hash), payload in zip(blocks, payloads, strict=True)])
        logger.info("persisted %d cached blocks in %.1fs", len(blocks), time.perf_counter() - t0)
        self.tiers.close()

    def _process_new_tokens(self, request: Request, num_new: int) -> RequestOutput:
        detok = self._detokenizers[request.request_id]
        new_ids = request.all_token_ids[-num_new:]
        # One token at a time (a step may bring accepted drafts), so a stop string ends the output where
        # plain decoding would.
        delta = ""
        # Stop strings count only from min_tokens on (as in vLLM); stop tokens are held back by the sampler.
        num_before = request.num_output_tokens - num_new
        min_tokens = request.sampling_params.min_tokens
        ended_later = False
        for i, token_id in enumerate(new_ids):
            delta += detok.add_tokens([token_id], check_stop=num_before + i + 1 >= min_tokens)
            if detok.stopped is not None:
                # A later token of the step (an accepted draft) may have ended the request (length, EOS):
                # plain decoding would have stopped at the string first.
                ended_later = i + 1 < num_new
                if ended_later:
                    request.truncate(request.num_tokens - (num_new - i - 1))
                    new_ids = new_ids[: i + 1]
                break
        if detok.stopped is not None:
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, FinishReason.STOP, stop_reason=detok.stopped)
            elif ended_later or request.finish_reason == FinishReason.LENGTH:
                # The string ended on the token that also reached max_tokens: a stop string wins over the
                # length limit, as in vLLM. (A stop token on that same token keeps its own stop_reason.)
                request.finish_reason, request.stop_reason = FinishReason.STOP, detok.stopped
        if request.is_finished and detok.stopped is None:
            delta += detok.flush()
        return self._make_output(request, new_ids, delta)

    def _make_output(self, request: Request, new_ids: list[int], delta: str) -> RequestOutput:
        detok = self._detokenizers[request.request_id]
        if request.is_finished:
            del self._detokenizers[request.request_id]
        reason = request.finish_reason.value if request.finish_reason is not None else None
        completion = CompletionOutput(
            index=0,
            text=detok.text,
            token_ids=request.output_token_ids,
            finish_reason=reason,
            stop_reason=request.stop_reason,
            logprobs=request.output_logprobs,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
            delta_text=delta,
            delta_token_ids=new_ids,
        )

    # --- observability ----------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.kv_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=kv.num_blocks,
            num_used_blocks=kv.pool.num_used,
            num_cached_blocks=kv.num_cached_blocks,
            num_free_blocks=kv.pool.num_free,
            num_evicted_blocks=kv.num_evicted_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_draft_tokens=self.scheduler.num_accepted_draft_tokens,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            num_generated_tokens=self._num_generated_tokens,
            num_steps=self._num_steps,
            busy_time_s=self._busy_time,
            cached_tokens_by_tier=dict(kv.stats.hits_by_tier),
            tiers=self.tiers.stats() if self.tiers is not None else {},
            tiers_healthy=self.tiers.healthy() if self.tiers is not None else {},
        )

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


def expand_n(params: SamplingParams) -> list[SamplingParams]:
    """n samples of one prompt as n engine requests; seeded ones get seed, seed+1, ... so they differ."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]


class LLM:
    """Offline batch generation, shaped like vLLM's ``LLM``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "bfloat16",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_gb: float = 1.0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "lpm",
        seed: int = 0,
        num_threads: int | None = None,
        cpu_kernels: bool = True,
        show_progress: bool = False,
        kv_host_gb: float = 0.0,
        kv_disk_gb: float = 0.0,
        kv_disk_dir: str | None = None,
        kv_redis_url: str | None = None,
        kv_retention_s: float = 72 * 3600.0,
        kv_write_policy: str = "write_back",
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        cascade_min_tokens: int = 256,
        shared_prefill_min_tokens: int | None = None,
    ) -> None:
        from kvserve.config import BackendConfig, CacheConfig, ModelConfig, SchedulerConfig

        if isinstance(speculative_config, dict):
            speculative_config = speculative_config_from_dict(speculative_config)

        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed,
                              num_threads=num_threads, cpu_kernels=cpu_kernels,
                              show_progress=show_progress),  # type: ignore[arg-type]
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_gb=kv_cache_gb,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      policy=scheduling_policy),  # type: ignore[arg-type]
            storage=StorageConfig(host_gb=kv_host_gb, disk_gb=kv_disk_gb, disk_dir=kv_disk_dir,
                                  redis_url=kv_redis_url, retention_s=kv_retention_s,
                                  write_policy=kv_write_policy),  # type: ignore[arg-type]
            speculative=speculative_config or SpeculativeConfig(),
            backend=BackendConfig(cascade_min_tokens=cascade_min_tokens,
                                  shared_prefill_min_tokens=shared_prefill_min_tokens),
        )
        self.engine = Engine(config)
        self._batch_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        self.engine.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequest("need one SamplingParams per prompt, or a single one", "sampling_params")

        batch = next(self._batch_ids)
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                ids = []
                for j, child in enumerate(expand_n(params)):
                    request = self.engine.add_request(prompt, child, request_id=f"llm{batch}-{i}-{j}")
                    ids.append(request.request_id)
                    added.append(request.request_id)
                groups.append(ids)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise

        final: dict[str, RequestOutput] = {}
        while len(final) < len(added):
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        return [self._merge([final[rid] for rid in ids]) for ids in groups]

    @staticmethod
    def _merge(outputs: list[RequestOutput]) -> RequestOutput:
        first = outputs[0]
        if len(outputs) == 1:
            return first
        completions = []
        for i, output in enumerate(outputs):
            completion = output.outputs[0]
            completion.index = i
            completions.append(completion)
        return replace(first, outputs=completions)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            # The template already holds any BOS token: don't add special tokens twice.
            prompts.append({"prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params)
