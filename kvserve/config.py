"""Frozen configuration dataclasses of the engine. Each component takes its own sub-config; EngineConfig composes
them (the HTTP server's and the gateway's are in ``kvserve/serving_config.py``).

These dataclasses, with those, are the one source of every engine and server option: a field's ``Setting`` metadata names
its CLI flag and ``LLM(...)`` keyword and carries its help text; ``kvserve/config_args.py`` builds the argparse
flags, the keywords and the README's flags table from them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, TypeVar, get_args

from kvserve.arch import ArchConfig as ArchConfig  # re-exported: the model description lives in kvserve.arch
from kvserve.errors import ConfigError


def check_whole(value: object, name: str, minimum: int, maximum: int | None = None) -> None:
    """ConfigError naming ``name`` unless ``value`` is a whole number in [minimum, maximum]."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (
            maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be {bounds} (a whole number), got {value!r}", name)


def check_finite(value: object, name: str, minimum: float, above: bool = False) -> None:
    """ConfigError naming ``name`` unless ``value`` is a finite number >= minimum (> minimum with ``above``)."""
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or value < minimum or (above and value == minimum)):
        raise ConfigError(f"{name} must be {'>' if above else '>='} {minimum} (a finite number), got {value!r}", name)

# vLLM's spellings too: auto (kvserve's default, bfloat16), half and float; ModelConfig keeps the names above.
DType = Literal["float32", "bfloat16", "float16", "auto", "half", "float"]
_DTYPE_ALIASES = {"auto": "bfloat16", "half": "float16", "float": "float32"}
Quantization = Literal["auto", "gguf", "none"]
# A draft's also "q4_0": its matrices held in wider types quantised again to Q4_0 at load.
DraftQuantization = Literal["auto", "gguf", "none", "q4_0"]
QuantizedActivations = Literal["auto", "int16", "int8"]
# How a reasoning model's thoughts are found (kvserve.reasoning): vLLM's parser names, none, or from the template.
ReasoningParser = Literal["auto", "none", "deepseek_r1", "qwen3"]
SchedulingPolicy = Literal["fcfs", "lpm", "priority"]
GrammarEngine = Literal["auto", "llguidance", "xgrammar"]

SETTING = "kvserve.setting"  # the metadata key of a field's Setting (or an EngineConfig field's Section)
DERIVED = ""  # Setting.flag / Setting.keyword: spelled from the field name


@dataclass(frozen=True, slots=True)
class Setting:
    """How a config field is set from outside. ``flag`` and ``keyword`` default to the field's name
    (``max_num_seqs`` -> ``--max-num-seqs``, ``max_num_seqs=``); ``None`` means there is none. A bool gets
    the pair ``--x/--no-x``, a Literal its choices; ``parse`` turns the flag's text into a value where the
    type alone does not say how; ``default_text`` shows the default in help and the flags table."""

    help: str = ""
    flag: str | None = DERIVED
    keyword: str | None = DERIVED
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    default_text: str | None = None


@dataclass(frozen=True, slots=True)
class Section:
    """On an EngineConfig field holding a sub-config: each of the sub-config's fields is an option of its own,
    its flags under the argparse group ``group``. An EngineConfig field without metadata is a Section named
    after the field."""

    group: str


def setting(default: Any, help: str = "", **options: Any) -> Any:
    """A dataclass field with a default and its Setting."""
    return field(default=default, metadata={SETTING: Setting(help=help, **options)})


def section(factory: Callable[[], Any], group: str) -> Any:
    return field(default_factory=factory, metadata={SETTING: Section(group)})


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(text: str) -> float:
    """Seconds in "72h", "30m", "5s", "2d" or a plain number of seconds."""
    value = text.strip().lower()
    scale = _DURATION_UNITS.get(value[-1:], None)
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise ConfigError(f"not a duration: {text!r} (try 72h, 30m, 5s or 3600)") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"a duration must be > 0, got {text!r}")
    return seconds


_COUNT_UNITS = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def token_count(text: str) -> int:
    """A whole number of tokens, in vLLM's spelling too: 32k is 32,000, 32K is 32,768, 25.6k is 25,600."""
    value = text.strip()
    scale = _COUNT_UNITS.get(value[-1:])
    try:
        count = Decimal(value[:-1] if scale else value) * (scale or 1)  # decimal: 1.001k is 1,001 exactly
    except InvalidOperation:
        raise ConfigError(f"not a number of tokens: {text!r} (try 4096, 32k or 32K)") from None
    if not count.is_finite() or count != count.to_integral_value():
        raise ConfigError(f"a number of tokens must be whole, got {text!r}")
    return int(count)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights to load and how. ``model=None`` means the default SmolLM2-135M-Instruct GGUF."""

    model: str | None = setting(None, "GGUF file, Hugging Face directory or known model name (`kvserve models "
                                      "list`; default: SmolLM2-135M-Instruct)")
    pull: bool = setting(False, "download a known model named by --model into the model store if it is not "
                                "there yet (`kvserve models pull`)")
    dtype: DType = setting("bfloat16", "dtype of the weights, the activations and the KV cache")
    quantization: Quantization = setting(
        "auto", "how a quantised GGUF file's weights run: gguf keeps its projection and embedding matrices in "
                "their blocks where the backend has kernels for their types (the rest is dequantised to --dtype); "
                "none dequantises every weight to --dtype at load; auto is gguf where the backend runs blocks at "
                "least as fast as dense weights under load (CPUs with AVX-512), else none")
    quantized_activations: QuantizedActivations = setting(
        "auto", "how the int8 kernels of weights kept in their blocks quantise the activations: int16 takes one "
                "int8 level per 16 values in decode steps, and keeps an int8 residual beside each int8 value in "
                "prompt chunks (as exact as bf16 activations); int8 takes one int8 level per 32 values at every "
                "width, as llama.cpp does: faster prefill, at the KL divergence docs/performance.md gives; auto is "
                "int8 for the known models whose quality with it is checked (`kvserve models list`), int16 for "
                "any other file. int8 needs AVX512-VNNI; elsewhere int16")
    device: str = setting("auto", "auto, cpu or cuda (auto picks CUDA when available, else CPU)")
    max_model_len: int | None = setting(None, "longest prompt plus output, in tokens: 4096, 32k (32,000) or 32K "
                                              "(32,768) (default: the model's own context length, capped by the "
                                              "KV pool)", parse=token_count)
    seed: int = setting(0, "seed of the sampler")
    num_threads: int | None = setting(None, "CPU threads for torch (default: torch's own choice)")
    cpu_kernels: bool = setting(True, "C++ CPU kernels for decode attention, the bf16 projections and the norms "
                                      "(built on first use); --no-cpu-kernels runs the torch reference paths")
    lora_modules: tuple[str, ...] = setting(
        (), "LoRA adapters (PEFT's adapter_config.json + adapter_model.safetensors directories) to serve beside the "
            "base model, as vLLM spells them: name=path, or '{\"name\": ..., \"path\": ...}'; a request names one "
            "as its model", metavar="NAME=PATH")
    chat_template: str | None = setting(
        None, "a Jinja chat template to render chats with instead of the model's own: a file's path, or the "
              "template itself", metavar="PATH_OR_TEMPLATE")
    reasoning_parser: ReasoningParser = setting(
        "auto", "how a reasoning model's thoughts are told from its answer (reasoning_content apart from content; a "
                "structured output's grammar and tool calls start after the thoughts; thinking_token_budget): "
                "deepseek_r1 or qwen3 (both <think> ... </think>), none, or auto: <think> when the chat template "
                "writes it")
    # LLM(...) turns it off unless asked for: offline scripts print their own output.
    show_progress: bool = setting(True, "a progress bar while the weights load (LLM(...): off unless asked for)",
                                  flag=None)

    def __post_init__(self) -> None:
        if self.dtype not in get_args(DType):
            raise ConfigError(f"dtype must be one of {', '.join(get_args(DType))}, got {self.dtype!r}", "dtype")
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))  # frozen: set once, here
        if self.quantization not in get_args(Quantization):  # a draft's may also be "q4_0"; a model's not
            raise ConfigError(f"quantization must be 'auto', 'gguf' or 'none', got {self.quantization!r}",
                              "quantization")
        if self.quantized_activations not in ("auto", "int16", "int8"):
            raise ConfigError("quantized_activations must be 'auto', 'int16' or 'int8', got "
                              f"{self.quantized_activations!r}",
                              "quantized_activations")
        if isinstance(self.lora_modules, str):
            object.__setattr__(self, "lora_modules", (self.lora_modules,))
        elif not isinstance(self.lora_modules, tuple):
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))
        names = [name for name, _ in self.lora_adapters()]
        if len(set(names)) != len(names):
            raise ConfigError(f"lora_modules names an adapter twice: {sorted(names)}", "lora_modules")
        if self.reasoning_parser not in get_args(ReasoningParser):
            raise ConfigError(f"reasoning_parser must be one of {', '.join(get_args(ReasoningParser))}, got "
                              f"{self.reasoning_parser!r}", "reasoning_parser")
        if self.pull and self.model is None:
            raise ConfigError("pull downloads the known model --model names: name one (`kvserve models list`)",
                              "pull")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}", "device")
        for name in ("max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                check_whole(getattr(self, name), name, 1)
        check_whole(self.seed, "seed", 0)


    def lora_adapters(self) -> list[tuple[str, str]]:
        """``lora_modules`` as (name, path) pairs."""
        return [lora_module(text) for text in self.lora_modules]


def lora_module(text: str) -> tuple[str, str]:
    """A LoRA module as vLLM's --lora-modules spells it: ``name=path`` or ``{"name": ..., "path": ...}``."""
    if not isinstance(text, str):
        raise ConfigError(f"a LoRA module is 'name=path', got {text!r}", "lora_modules")
    if text.lstrip().startswith("{"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"LoRA module {text!r} is not JSON: {exc}", "lora_modules") from None
        name, path = (values.get("name"), values.get("path")) if isinstance(values, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise ConfigError(f"a LoRA module is 'name=path' or '{{\"name\": ..., \"path\": ...}}', got {text!r}",
                          "lora_modules")
    return name.strip(), path.strip()


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block (a power of two)")
    num_kv_blocks: int | None = setting(None, "KV pool size in blocks (overrides --kv-cache-gb)")
    kv_cache_gb: float = setting(1.0, "KV pool size in GiB")
    enable_prefix_caching: bool = setting(True, "reuse the KV of prompt prefixes computed before")
    keep_tails: bool = setting(True, "the prefix cache also keeps a finished request's partly filled last block "
                                     "(--no-keep-tails: full blocks only)")
    window_pages: bool = setting(True, "sliding-window layers keep KV pages for their window only, freed as it "
                                       "moves on (--no-window-pages: every layer keeps every block)")
    hash_salt: str = setting("", "extra key mixed into every block hash (an adapter or tenant salt): engines "
                                 "with different salts never share cached KV")

    def __post_init__(self) -> None:
        check_whole(self.block_size, "block_size", 1)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}", "block_size")
        if self.num_kv_blocks is not None:
            check_whole(self.num_kv_blocks, "num_kv_blocks", 1)
        check_finite(self.kv_cache_gb, "kv_cache_gb", 0, above=True)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = setting(64, "most requests in one batch")
    max_num_batched_tokens: int = setting(1024, "most tokens one step computes (prefill chunks and decodes)")
    # lpm by default: lower TTFT and higher throughput than fcfs on the agentic workload, same hit rate
    # (benchmarks/prefix_cache.py).
    policy: SchedulingPolicy = setting("lpm", "fcfs: arrival order; lpm: longest cached prefix first; priority: "
                                              "the requests' own priorities (vLLM's): the lowest value first, then "
                                              "arrival order, and the highest value (least urgent) preempted first",
                                       flag="--scheduling-policy", keyword="scheduling_policy")
    lpm_max_skips: int = setting(8, "lpm only: a waiting request passed over this many times is served next "
                                    "regardless of its cached prefix")
    lpm_window: int = setting(64, "lpm only: how many waiting requests, from the head of the queue, are "
                                  "compared by cached prefix")

    def __post_init__(self) -> None:
        check_whole(self.max_num_seqs, "max_num_seqs", 1)
        check_whole(self.max_num_batched_tokens, "max_num_batched_tokens", 1)
        if self.policy not in ("fcfs", "lpm", "priority"):
            raise ConfigError(f"policy must be 'fcfs', 'lpm' or 'priority', got {self.policy!r}", "policy")
        check_whole(self.lpm_window, "lpm_window", 1)
        check_whole(self.lpm_max_skips, "lpm_max_skips", 0)


WritePolicy = Literal["write_back", "write_through"]


DEFAULT_DISK_GB = 16.0  # the disk tier's capacity when --kv-disk-dir comes without --kv-disk-gb


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Lower KV tiers below device memory. All off by default.

    ``write_back``: a block goes down to the host tier when device memory evicts it, and on to disk / Redis
    when the host tier evicts it. ``write_through``: every full block goes to every tier as soon as it is
    computed (what survives a restart or is shared between engines does not wait for an eviction).
    """

    host_gb: float = setting(0.0, "host DRAM tier size in GiB", flag="--kv-host-gb", keyword="kv_host_gb")
    disk_gb: float | None = setting(None, f"disk tier size in GiB (needs --kv-disk-dir; default "
                                          f"{DEFAULT_DISK_GB:g}, or half the free space there if that is less)",
                                    flag="--kv-disk-gb", keyword="kv_disk_gb", default_text="auto")
    disk_dir: str | None = setting(None, "directory of the disk tier (survives restarts)", flag="--kv-disk-dir",
                                   keyword="kv_disk_dir")
    redis_url: str | None = setting(None, "Redis tier, e.g. redis://127.0.0.1:6379/0 (shareable)",
                                    flag="--kv-redis-url", keyword="kv_redis_url")
    retention_s: float = setting(72 * 3600.0, "how long tier entries live: 72h, 30m, 5s or plain seconds "
                                              "(LLM(...): seconds)", flag="--kv-retention",
                                 keyword="kv_retention_s", parse=duration_seconds, metavar="DURATION",
                                 default_text="72h")
    write_policy: WritePolicy = setting("write_back", "write_back: blocks go down as they are evicted; "
                                                      "write_through: as soon as they fill",
                                        flag="--kv-write-policy", keyword="kv_write_policy")

    def __post_init__(self) -> None:
        for name in ("host_gb", "disk_gb"):
            value = getattr(self, name)
            if value is None and name == "disk_gb":
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}", name)
        if self.disk_gb and not self.disk_dir:
            raise ConfigError("disk_gb needs disk_dir (where the disk tier keeps its files)", "disk_dir")
        if self.disk_dir and self.disk_gb == 0:
            raise ConfigError("disk_gb must be > 0 with disk_dir (leave it out for the default capacity)",
                              "disk_gb")
        if not 0 < self.retention_s < float("inf"):
            raise ConfigError(f"retention_s must be a finite number > 0, got {self.retention_s!r}", "retention_s")
        if self.redis_url is not None and not self.redis_url.lower().startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}",
                              "redis_url")
        if self.write_policy not in ("write_back", "write_through"):
            raise ConfigError(
                f"write_policy must be 'write_back' or 'write_through', got {self.write_policy!r}", "write_policy"
            )

    @property
    def enabled(self) -> bool:
        return self.host_gb > 0 or bool(self.disk_dir) or self.redis_url is not None


SpeculativeMethod = Literal["none", "ngram", "draft_model"]
SPECULATIVE_METHODS: tuple[str, ...] = ("none", "ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (off by default); up to ``num_speculative_tokens`` drafts a step are verified in one
    forward, exactly (see runner/speculative.py).

    ``ngram``: prompt lookup. The suffix of a request's tokens (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens long) is searched for in its earlier tokens (prompt and output); the tokens
    that followed the latest match are the draft.
    ``draft_model``: a smaller ``model`` with the same tokenizer runs beside the target on its own KV blocks
    and proposes the drafts, one batched forward per draft token. With ``prompt_lookup``, a request whose
    own tokens hold a match for its last ones gets the lookup's drafts that step, and the draft model runs
    for the others only.

    With ``adaptive`` (the default) the number of drafts each request gets is chosen every step from the
    measured acceptance and the measured cost of a row, for the most tokens per second; it falls to none
    when verifying costs more than it returns."""

    method: SpeculativeMethod = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model (method draft_model): a name `kvserve models` knows, or a path
    # How the draft's quantised GGUF weights run (as --quantization); None: as the target's. A draft decodes
    # a row or a few at a time, where GGUF blocks are fastest, even on CPUs where auto keeps dense weights.
    # "q4_0" also quantises again to Q4_0 each matrix the file holds in a wider type: a draft's forward reads
    # its weights once a token, and its rounding only moves acceptance (verification keeps the output exact).
    quantization: DraftQuantization | None = None
    # The draft proposes only from a part of the vocabulary (its output projection cut to those rows, and
    # each request's own prompt ids): with ``draft_token_map`` (a file `kvserve models token-map` writes:
    # ids ranked by their frequency in a corpus) its first ``draft_vocab_size`` ids (all, if None), else the
    # ids below ``draft_vocab_size`` (a BPE tokenizer's earliest merges); neither: the whole vocabulary. A
    # draft's output projection can be a third of what it reads a token; a target token the pruned draft
    # cannot propose is a rejected draft, never a wrong token.
    draft_vocab_size: int | None = None
    draft_token_map: str | None = None
    prompt_lookup: bool = False  # draft_model: prompt lookup first, the draft model where it finds nothing
    adaptive: bool = True
    # No drafts in a step that samples for this many requests or more (vLLM's option of the same name); the
    # adaptive rule usually gets there by itself.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}, "
                              f"got {self.method!r}", "method")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", name)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got "
                              f"{self.num_speculative_tokens}", "num_speculative_tokens")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError(f"disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}",
                              "disable_by_batch_size")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})", "prompt_lookup_min")
        if self.quantization is not None and self.quantization not in get_args(DraftQuantization):
            raise ConfigError(f"quantization must be one of {', '.join(map(repr, get_args(DraftQuantization)))}, got "
                              f"{self.quantization!r}", "quantization")
        for name in ("adaptive", "prompt_lookup"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}", name)
        size = self.draft_vocab_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ConfigError(f"draft_vocab_size must be an integer >= 1, got {size!r}", "draft_vocab_size")
        if self.draft_token_map is not None and (not isinstance(self.draft_token_map, str) or not self.draft_token_map):
            raise ConfigError(f"draft_token_map must be a file path, got {self.draft_token_map!r}", "draft_token_map")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError("method 'draft_model' needs the draft's 'model' (a name or a path)", "model")
        else:
            for name in ("model", "quantization", "draft_vocab_size", "draft_token_map", "prompt_lookup"):
                if getattr(self, name) not in (None, False):
                    raise ConfigError(f"'{name}' is the draft's, of method 'draft_model'; method is {self.method!r}",
                                      name)

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True, slots=True)
class StructuredOutputConfig:
    """Grammar-constrained decoding (response_format, tools, structured_outputs): how constraints compile."""

    compile_timeout_s: float = setting(
        10.0, "seconds a request waits for its grammar to compile before it gets a 400 (the compile goes on "
              "and is cached for a retry)", flag="--grammar-compile-timeout", keyword="grammar_compile_timeout")
    cache_size: int = setting(256, "compiled grammars kept, by constraint (least recently used dropped first)",
                              flag="--grammar-cache-size", keyword="grammar_cache_size")
    compile_threads: int = setting(2, "threads that compile grammars, off the engine and HTTP threads",
                                   flag="--grammar-compile-threads", keyword="grammar_compile_threads")
    engine: GrammarEngine = setting(
        "auto", "grammar engine: auto (xgrammar's precomputed masks for a small JSON Schema with "
                "length-bounded strings whose every keyword xgrammar enforces, where xgrammar is installed; "
                "llguidance for the rest), llguidance, or xgrammar (every JSON Schema whose keywords it "
                "enforces)",
        flag="--grammar-engine",
        keyword="grammar_engine")

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ConfigError(f"grammar compile timeout must be > 0, got {self.compile_timeout_s}",
                              "compile_timeout_s")
        for name in ("cache_size", "compile_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", name)
        if self.engine not in get_args(GrammarEngine):
            raise ConfigError(f"grammar engine must be one of {', '.join(get_args(GrammarEngine))}, got "
                              f"{self.engine!r}", "engine")


C = TypeVar("C")


def config_from_dict(cls: type[C], values: Mapping[str, object], label: str) -> C:
    """A sub-config from a mapping of its field names, e.g. vLLM's speculative config
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {label} config field(s) {', '.join(unknown)}; expected some of "
                          f"{', '.join(sorted(known))}", unknown[0])
    return cls(**values)


def speculative_config_from_json(text: str) -> SpeculativeConfig:
    """``--speculative-config``: vLLM's JSON spelling of SpeculativeConfig."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}", "speculative_config") from None
    if not isinstance(values, dict):
        raise ConfigError("--speculative-config must be a JSON object", "speculative_config")
    if values.get("method") is None and values.get("model") is not None:  # vLLM infers the method from the model
        values = ({k: v for k, v in values.items() if k != "model"} | {"method": "ngram"}
                  if values["model"] in ("ngram", "[ngram]") else values | {"method": "draft_model"})
    return config_from_dict(SpeculativeConfig, values, "speculative")


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """Thresholds of the kernel backends (model/backends/); outputs do not depend on them beyond rounding."""

    cascade_min_tokens: int = setting(
        256, "decodes sharing at least this many prefix tokens read the shared KV once (cascade attention)")
    shared_prefill_min_tokens: int | None = setting(
        None, "prefill chunks sharing at least this many keys in the same blocks get them packed once per layer "
              "and kept across steps (AMX attention)", default_text="--cascade-min-tokens")
    decode_split_size: int = setting(
        256, "keys per work item of the decode attention kernel: short enough that one long sequence still "
             "spreads over every core")
    enforce_eager: bool = setting(False, "CUDA: run every step eagerly, without CUDA graphs")
    cuda_graph_max_rows: int = setting(
        256, "CUDA: decode steps of up to this many rows (requests and their drafts; at most --max-num-seqs "
             "times 1 + the drafts a request may get) replay CUDA graphs, padded to the next captured size "
             "(1, 2, 4, then multiples of 8); wider steps run eagerly")
    cuda_graph_max_seq_len: int = setting(
        8192, "CUDA: the longest sequence a CUDA-graph decode step holds; a step with a longer one runs eagerly")

    def __post_init__(self) -> None:
        for name in ("cascade_min_tokens", "shared_prefill_min_tokens", "decode_split_size", "cuda_graph_max_rows",
                     "cuda_graph_max_seq_len"):
            value = getattr(self, name)
            if value is None and name == "shared_prefill_min_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", name)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every engine option. A field holding a sub-config is a Section (each sub-config field is an option);
    ``speculative`` is one option, set whole (vLLM's ``--speculative-config`` JSON)."""

    model: ModelConfig = section(ModelConfig, "engine")
    cache: CacheConfig = section(CacheConfig, "engine")
    scheduler: SchedulerConfig = section(SchedulerConfig, "engine")
    storage: StorageConfig = section(StorageConfig, "KV storage tiers (below device memory; all off by default)")
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig, metadata={SETTING: Setting(
        help='speculative decoding, as vLLM spells it: \'{"method": "draft_model", "model": "qwen2.5-coder-0.5b", '
             '"num_speculative_tokens": 4}\' or \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (exact: the output distribution does not change; '
             'draft lengths adapt to acceptance and load unless "adaptive": false); LLM(...) also takes a dict '
             'or a SpeculativeConfig',
        flag="--speculative-config", keyword="speculative_config", parse=speculative_config_from_json,
        metavar="JSON", default_text="off")})
    backend: BackendConfig = section(BackendConfig, "kernel backend")
    structured: StructuredOutputConfig = section(StructuredOutputConfig, "structured output")

    def __post_init__(self) -> None:
        if self.storage.enabled and not self.cache.enable_prefix_caching:
            raise ConfigError("the KV tiers (--kv-host-gb, --kv-disk-dir, --kv-redis-url) extend the prefix cache: "
                              "drop --no-enable-prefix-caching, or the tier options", "enable_prefix_caching")
