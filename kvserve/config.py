"""Frozen configuration dataclasses. Each component takes its own sub-config; EngineConfig composes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvserve.arch import ArchConfig as ArchConfig  # re-exported: the model description lives in kvserve.arch
from kvserve.errors import InvalidRequest

DType = Literal["float32", "bfloat16", "float16"]
SchedulingPolicy = Literal["fcfs", "lpm"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights to load and how. ``model=None`` means the default SmolLM2-135M-Instruct GGUF."""

    model: str | None = None
    dtype: DType = "bfloat16"
    device: str = "auto"  # "auto" picks CUDA when available, else CPU
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    num_threads: int | None = None  # CPU threads for torch; None leaves torch's default
    # The C++ CPU kernels (decode attention, bf16 projections, norms) when they build; False: torch paths only.
    cpu_kernels: bool = True
    show_progress: bool = True


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit block count wins over kv_cache_gb
    kv_cache_gb: float = 1.0
    enable_prefix_caching: bool = True
    # Extra keys mixed into every block hash (model fingerprint, adapter, tenant salt).
    hash_salt: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequest(f"block_size must be a power of two >= 1, got {self.block_size}", "block_size")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequest(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}", "num_kv_blocks")
        if self.kv_cache_gb <= 0:
            raise InvalidRequest(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}", "kv_cache_gb")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    policy: SchedulingPolicy = "lpm"  # measured better on the agentic workload (README)
    # lpm only: a waiting request passed over this many times is served next regardless of its hit.
    lpm_max_skips: int = 8
    max_waiting_requests: int | None = None  # None: unbounded (the server sets a bound)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequest(f"max_num_seqs must be >= 1, got {self.max_num_seqs}", "max_num_seqs")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequest(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}", "max_num_batched_tokens"
            )
        if self.policy not in ("fcfs", "lpm"):
            raise InvalidRequest(f"policy must be 'fcfs' or 'lpm', got {self.policy!r}", "policy")


WritePolicy = Literal["write_back", "write_through"]


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Lower KV tiers below device memory. All off by default.

    ``write_back``: a block goes down to the host tier when device memory evicts it, and on to disk / Redis
    when the host tier evicts it. ``write_through``: every full block goes to every tier as soon as it is
    computed (what survives a restart or is shared between engines does not wait for an eviction).
    """

    host_gb: float = 0.0
    disk_gb: float = 0.0
    disk_dir: str | None = None
    redis_url: str | None = None
    retention_s: float = 72 * 3600.0
    write_policy: WritePolicy = "write_back"

    def __post_init__(self) -> None:
        for name in ("host_gb", "disk_gb"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise InvalidRequest(f"{name} must be a number >= 0, got {value!r}", name)
        if self.disk_gb > 0 and not self.disk_dir:
            raise InvalidRequest("disk_gb > 0 needs disk_dir (where the disk tier keeps its files)", "disk_dir")
        if self.disk_dir and self.disk_gb <= 0:
            raise InvalidRequest("disk_dir needs disk_gb > 0 (the disk tier's capacity)", "disk_gb")
        if not 0 < self.retention_s < float("inf"):
            raise InvalidRequest(f"retention_s must be a finite number > 0, got {self.retention_s!r}", "retention_s")
        if self.write_policy not in ("write_back", "write_through"):
            raise InvalidRequest(
                f"write_policy must be 'write_back' or 'write_through', got {self.write_policy!r}", "write_policy"
            )

    @property
    def enabled(self) -> bool:
        return self.host_gb > 0 or (self.disk_gb > 0 and self.disk_dir is not None) or self.redis_url is not None


SpeculativeMethod = Literal["none", "ngram"]


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (off by default). ``ngram``: prompt lookup. The suffix of a request's tokens
    (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens long) is searched for in its earlier tokens
    (prompt and output); the tokens that followed the latest match are the draft. Up to
    ``num_speculative_tokens`` drafts a step are verified in one forward, exactly (see runner/speculative.py)."""

    method: SpeculativeMethod = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No drafts in a step that samples for this many requests or more: a big batch already fills the
    # compute, and every draft row costs a share of it (vLLM's option of the same name).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("none", "ngram"):
            raise InvalidRequest(f"speculative method must be 'none' or 'ngram', got {self.method!r}", "method")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}", name)
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise InvalidRequest(f"disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}",
                                 "disable_by_batch_size")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequest(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})", "prompt_lookup_min")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def speculative_config_from_dict(fields: dict[str, object]) -> SpeculativeConfig:
    """vLLM's spelling, e.g. ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``."""
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidRequest(f"unknown speculative config field(s) {', '.join(unknown)}; expected some of "
                             f"{', '.join(sorted(known))}", unknown[0])
    return SpeculativeConfig(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting_requests: int = 256
    # Larger bodies get 413 before they are read: parsing and tokenizing megabytes stalls every request.
    max_request_body_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
