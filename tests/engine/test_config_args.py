"""The CLI flags, the LLM(...) keywords and the README's flags table, all generated from kvserve/config.py."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvserve import config_args
from kvserve.cli import build_parser, engine_config_from_args
from kvserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StorageConfig,
    setting,
)
from kvserve.config_args import (
    engine_config_from_keywords,
    engine_options,
    flags_table,
    server_config_from_args,
    server_options,
)
from kvserve.errors import ConfigError
from kvserve.serving_config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]

# Every flag the CLI had before its flags were generated, spelled as users type them.
ENGINE_FLAGS = [
    "--model", "--dtype", "--device", "--block-size", "--num-kv-blocks", "--kv-cache-gb", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--scheduling-policy", "--seed", "--num-threads", "--cpu-kernels", "--no-cpu-kernels", "--speculative-config",
    "--kv-host-gb", "--kv-disk-gb", "--kv-disk-dir", "--kv-redis-url", "--kv-retention", "--kv-write-policy",
]
SERVE_FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--max-waiting-requests",
               "--max-request-body-bytes", "--shutdown-grace-period", "--uvicorn-log-level"]
# Every keyword LLM(...) took before its keywords were generated.
LLM_KEYWORDS = [
    "model", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_gb", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "scheduling_policy", "seed", "num_threads",
    "cpu_kernels", "show_progress", "kv_host_gb", "kv_disk_gb", "kv_disk_dir", "kv_redis_url", "kv_retention_s",
    "kv_write_policy", "speculative_config",
]


def subcommand_flags(name: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]  # type: ignore[union-attr]
    return {flag for action in sub._actions for flag in action.option_strings}


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_flag_keeps_its_spelling(command: str) -> None:
    flags = subcommand_flags(command)
    assert set(ENGINE_FLAGS) <= flags
    assert (set(SERVE_FLAGS) <= flags) == (command == "serve")


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_parser_defaults_are_the_dataclass_defaults(command: str) -> None:
    args = parse(command)
    assert engine_config_from_args(args) == EngineConfig()
    for option in engine_options() + (server_options() if command == "serve" else []):
        if option.flag is not None:
            assert getattr(args, option.dest) == option.default, option.flag
    if command == "serve":
        assert server_config_from_args(args) == ServerConfig()


def test_the_defaults_once_written_three_times() -> None:
    config = engine_config_from_args(parse("serve"))
    assert config.scheduler.max_num_batched_tokens == 1024 and config.scheduler.policy == "lpm"
    assert config.storage.retention_s == 72 * 3600 and config.model.show_progress
    assert ServerConfig().shutdown_grace_period_s == 5.0 and ServerConfig().uvicorn_log_level == "info"


def test_every_flag_reaches_its_field() -> None:
    args = parse(
        "serve", "--model", "/m.gguf", "--dtype", "float32", "--device", "cpu", "--block-size", "32",
        "--num-kv-blocks", "100", "--kv-cache-gb", "2.5", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--max-model-len", "2048", "--enable-prefix-caching", "--scheduling-policy", "fcfs", "--seed", "7",
        "--num-threads", "3", "--no-cpu-kernels", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--kv-host-gb", "4", "--kv-disk-gb", "20", "--kv-disk-dir", "/var/kv", "--kv-redis-url", "redis://h:1/0",
        "--kv-retention", "30m", "--kv-write-policy", "write_through", "--no-keep-tails", "--hash-salt", "tenant",
        "--lpm-max-skips", "3", "--lpm-window", "16",
        "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "m", "m-alias", "--api-key", "k",
        "--max-waiting-requests", "3", "--max-request-body-bytes", "1000", "--shutdown-grace-period", "2.5",
        "--uvicorn-log-level", "debug",
    )
    assert engine_config_from_args(args) == EngineConfig(
        model=ModelConfig(model="/m.gguf", dtype="float32", device="cpu", max_model_len=2048, seed=7, num_threads=3,
                          cpu_kernels=False),
        cache=CacheConfig(block_size=32, num_kv_blocks=100, kv_cache_gb=2.5, enable_prefix_caching=True,
                          keep_tails=False, hash_salt="tenant"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, policy="fcfs", lpm_max_skips=3,
                                  lpm_window=16),
        storage=StorageConfig(host_gb=4.0, disk_gb=20.0, disk_dir="/var/kv", redis_url="redis://h:1/0",
                              retention_s=1800.0, write_policy="write_through"),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    assert server_config_from_args(args) == ServerConfig(
        host="0.0.0.0", port=9000, served_model_name=("m", "m-alias"), api_key="k", max_waiting_requests=3,
        max_request_body_bytes=1000, shutdown_grace_period_s=2.5, uvicorn_log_level="debug")


def test_one_served_model_name_is_a_tuple_of_one_and_an_empty_one_is_refused() -> None:
    assert ServerConfig(served_model_name="m").served_model_name == ("m",)
    assert server_config_from_args(parse("serve", "--served-model-name", "m")).served_model_name == ("m",)
    with pytest.raises(ConfigError, match="served_model_name"):
        ServerConfig(served_model_name=("m", " "))


def test_boolean_pairs() -> None:
    for flag, path in (("enable-prefix-caching", ("cache", "enable_prefix_caching")),
                       ("cpu-kernels", ("model", "cpu_kernels"))):
        on = engine_config_from_args(parse("generate", f"--{flag}"))
        off = engine_config_from_args(parse("generate", f"--no-{flag}"))
        assert getattr(getattr(on, path[0]), path[1]) is True
        assert getattr(getattr(off, path[0]), path[1]) is False


@pytest.mark.parametrize(("text", "seconds"), [("30m", 1800.0), ("72h", 259200.0), ("5s", 5.0), ("90", 90.0)])
def test_retention_takes_a_duration(text: str, seconds: float) -> None:
    assert engine_config_from_args(parse("serve", "--kv-retention", text)).storage.retention_s == seconds


def test_bad_flag_values_are_usage_errors(capsys) -> None:
    for argv in (["--kv-retention", "soon"], ["--scheduling-policy", "random"], ["--speculative-config", "[1]"],
                 ["--block-size", "big"]):
        with pytest.raises(SystemExit) as info:
            parse("generate", *argv)
        assert info.value.code == 2
    assert "not a duration: 'soon'" in capsys.readouterr().err


def test_a_config_error_from_flags_exits_2(capsys) -> None:
    from kvserve.cli import main

    assert main(["generate", "--block-size", "12"]) == 2
    assert "kvserve: error: block_size must be a power of two >= 1, got 12" in capsys.readouterr().err


def test_flags_are_taken_by_their_full_names_only(capsys) -> None:
    """argparse took ``--replica 2`` for ``--replicas 2``; the replicas' argument lists, rewritten by full flag
    names, then carried it on, and each replica started replicas of its own."""
    for argv in (["serve", "--replica", "2"], ["serve", "--kv-disk-d", "/tmp/kv"], ["models", "pull", "x", "--qui"],
                 ["--log-lev", "info", "models", "list"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        assert info.value.code == 2
    assert "unrecognized arguments: --replica 2" in capsys.readouterr().err
    assert build_parser().parse_args(["--log-level", "info", "models", "list"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "verbose", "models", "list"])
    assert "invalid choice: 'VERBOSE'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "x"], "--batch-sizes takes comma-separated numbers > 0, got 'x'"),  # a traceback before
    (["--batch-sizes", "0"], "--batch-sizes takes comma-separated numbers > 0, got '0'"),  # $0 per token
    (["--days", "x"], "--days takes comma-separated numbers > 0"),
    (["--context", "-5"], "--context must be >= 1, got -5"),
    (["--num-gpus", "0"], "--num-gpus must be >= 1, got 0"),
    (["--from-bench", "/no/such/bench.json"], "--from-bench /no/such/bench.json: no such file"),
])
def test_cost_settings_are_refused_by_name(capsys, argv: list[str], message: str) -> None:
    from kvserve.cli import main

    assert main(["cost", *argv]) == 2
    assert f"kvserve: error: {message}" in capsys.readouterr().err


def test_train_probe_inputs_are_refused_by_name(capsys, tmp_path) -> None:
    """A missing or malformed examples file was a traceback; a NaN regularisation saved a probe that sent
    every request to the small model."""
    from kvserve.cli import main

    base = ["eval", "train-probe", "--model", "m", "--out", str(tmp_path / "probe.json"), "--base-url",
            "http://127.0.0.1:9"]
    assert main([*base, "--examples", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "label": 1}\n{not json\n')
    assert main([*base, "--examples", str(bad)]) == 2
    assert "bad.jsonl:2: an example is" in capsys.readouterr().err
    assert main([*base, "--examples", str(bad), "--l2", "nan"]) == 2
    assert "--l2 must be a finite number > 0, got nan" in capsys.readouterr().err


def test_settings_are_refused_before_the_model_loads(capsys, monkeypatch) -> None:
    from kvserve.cli import main

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # serve's own setting, undone after the test

    assert main(["serve", "--routing-policy", "round_robin"]) == 2  # one server: ignored before
    assert "--routing-policy chooses among replicas" in capsys.readouterr().err
    assert main(["trace", "--repeat", "0"]) == 2  # printed nothing and exited 0 before
    assert "--repeat must be >= 1, got 0" in capsys.readouterr().err

    assert main(["generate", "--temperature", "-1", "--model", "/no/such/model.gguf"]) == 2
    assert "temperature must be a finite number >= 0, got -1.0" in capsys.readouterr().err
    assert main(["serve", "--hardware", "h100x", "--model", "/no/such/model.gguf"]) == 2
    assert "unknown hardware 'h100x'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["eval", "humaneval", "--concurrency", "0"], "--concurrency must be >= 1, got 0"),  # it waited forever
    (["eval", "humaneval", "--limit", "-3"], "--limit must be >= 1, got -3"),
    (["eval", "humaneval", "--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
    (["bench", "--duration", "nan"], "duration must be a finite number of seconds > 0, got nan"),  # never ended
    (["bench", "--duration", "0"], "duration must be a finite number of seconds > 0, got 0.0"),
    (["bench", "--request-rate", "nan"], "request rate must be > 0, got nan"),
    (["bench", "--max-concurrency", "0"], "max concurrency must be >= 1, got 0"),
    (["bench", "--hardware", "h100x"], "unknown hardware 'h100x'"),  # found only after the whole run
    (["bench", "--output", "/no/such/dir/x.json"], "--output /no/such/dir/x.json: not a file that can be written"),
    (["bench", "--sweep", "1,4,0"], "concurrency must be >= 1, got 0"),  # after two points had run
    (["bench", "--sweep", "2.5"], "a concurrency sweep takes whole numbers, got 2.5"),  # ran 2
    (["bench", "--sweep", "1,nan"], "a concurrency sweep takes whole numbers, got nan"),
    (["bench", "--request-rate", "1", "--sweep", "1,nan"], "request rate must be > 0, got nan"),
    (["eval", "humaneval", "--out", "/no/such/dir/x.json"], "--out /no/such/dir/x.json: not a file"),
])
def test_eval_and_bench_settings_are_refused_before_any_request(capsys, argv: list[str], message: str) -> None:
    from kvserve.cli import main

    assert main([*argv, "--base-url", "http://127.0.0.1:9"]) == 2  # a port nothing listens on: never reached
    assert f"kvserve: error: {message}" in capsys.readouterr().err


# --- LLM(...) keywords ---------------------------------------------------------------------------------------
def test_every_llm_keyword_is_kept_and_unique() -> None:
    keywords = [o.keyword for o in engine_options() if o.keyword is not None]
    assert len(keywords) == len(set(keywords))
    assert set(LLM_KEYWORDS) <= set(keywords)


def test_keywords_map_to_their_fields() -> None:
    config = engine_config_from_keywords({
        "model": "/m.gguf", "dtype": "float32", "device": "cpu", "block_size": 8, "num_kv_blocks": 64,
        "kv_cache_gb": 0.5, "max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 512,
        "enable_prefix_caching": True, "scheduling_policy": "fcfs", "seed": 3, "num_threads": 2,
        "cpu_kernels": False, "show_progress": False, "kv_host_gb": 1.0, "kv_disk_gb": 2.0, "kv_disk_dir": "/d",
        "kv_redis_url": "redis://r", "kv_retention_s": 60.0, "kv_write_policy": "write_through",
        "keep_tails": False, "lpm_window": 4, "speculative_config": {"method": "ngram"},
    })
    assert config == EngineConfig(
        model=ModelConfig(model="/m.gguf", dtype="float32", device="cpu", max_model_len=512, seed=3, num_threads=2,
                          cpu_kernels=False, show_progress=False),
        cache=CacheConfig(block_size=8, num_kv_blocks=64, kv_cache_gb=0.5, enable_prefix_caching=True,
                          keep_tails=False),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, policy="fcfs", lpm_window=4),
        storage=StorageConfig(host_gb=1.0, disk_gb=2.0, disk_dir="/d", redis_url="redis://r", retention_s=60.0,
                              write_policy="write_through"),
        speculative=SpeculativeConfig(method="ngram"),
    )
    assert engine_config_from_keywords({}) == EngineConfig()
    assert not engine_config_from_keywords({"enable_prefix_caching": False}).cache.enable_prefix_caching


def test_speculative_config_takes_a_dict_the_dataclass_or_none() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert engine_config_from_keywords({"speculative_config": spec}).speculative is spec
    assert engine_config_from_keywords({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
                                       ).speculative == spec
    assert engine_config_from_keywords({"speculative_config": None}).speculative == SpeculativeConfig()
    with pytest.raises(ConfigError, match=re.escape("unknown speculative config field(s) draft_model")):
        engine_config_from_keywords({"speculative_config": {"draft_model": "x"}})
    with pytest.raises(ConfigError, match="speculative_config must be a SpeculativeConfig"):
        engine_config_from_keywords({"speculative_config": "ngram"})


def test_unknown_keywords_name_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        engine_config_from_keywords({"max_num_seq": 4, "kv_host_gb": 1.0})
    assert info.value.param == "max_num_seq"
    assert "unknown LLM keyword(s) max_num_seq" in str(info.value)
    assert "max_num_seqs" in str(info.value) and "kv_retention_s" in str(info.value)


def test_llm_refuses_an_unknown_keyword_before_loading_anything() -> None:
    from kvserve.offline import LLM

    with pytest.raises(ConfigError, match="unknown LLM keyword"):
        LLM(dtype="float32", polcy="fcfs")
    with pytest.raises(ConfigError, match="max_num_seqs must be >= 1"):
        LLM(max_num_seqs=0)


def test_config_validation_raises_config_error() -> None:
    for make, param in ((lambda: CacheConfig(block_size=3), "block_size"),
                        (lambda: SchedulerConfig(policy="random"), "policy"),  # type: ignore[arg-type]
                        (lambda: SchedulerConfig(lpm_window=0), "lpm_window"),
                        (lambda: StorageConfig(disk_gb=1.0), "disk_dir"),
                        (lambda: SpeculativeConfig(method="eagle"), "method")):  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as info:
            make()
        assert info.value.param == param


# --- a sub-config added later gets its flags and keywords as it is -------------------------------------------
@dataclass(frozen=True, slots=True)
class ExtraConfig:
    split_size: int = setting(32, "rows per split")
    fast: bool = True  # no metadata: a flag and a keyword spelled from the name


@dataclass(frozen=True, slots=True)
class EngineConfigWithExtra:
    model: ModelConfig = field(default_factory=ModelConfig)
    extra: ExtraConfig = field(default_factory=ExtraConfig)


def test_a_new_sub_config_gets_flags_and_keywords(monkeypatch) -> None:
    monkeypatch.setattr(config_args, "EngineConfig", EngineConfigWithExtra)
    args = parse("generate", "--split-size", "8", "--no-fast")
    assert engine_config_from_args(args) == EngineConfigWithExtra(extra=ExtraConfig(split_size=8, fast=False))
    assert engine_config_from_keywords({"split_size": 4}).extra == ExtraConfig(split_size=4)  # type: ignore[attr-defined]
    assert "| `--split-size` | `split_size` | `32` | rows per split |" in flags_table()


# --- the README's table --------------------------------------------------------------------------------------
def test_readme_flags_table_is_the_generated_one() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- flags-table:start -->\n(.*?)<!-- flags-table:end -->", text, re.S)
    assert match, "README.md lacks the flags-table markers"
    assert match.group(1) == flags_table(), "stale: run python3 scripts/flags_table.py"


def test_flags_table_script_check() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "flags_table.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_flags_table_script_check_finds_a_stale_table(tmp_path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text("intro\n<!-- flags-table:start -->\n| old |\n<!-- flags-table:end -->\nrest\n")
    script = str(ROOT / "scripts" / "flags_table.py")
    check = subprocess.run([sys.executable, script, "--check", "--readme", str(stale)], capture_output=True, text=True)
    assert check.returncode == 1 and "stale" in check.stderr
    assert subprocess.run([sys.executable, script, "--readme", str(stale)]).returncode == 0
    assert stale.read_text() == f"intro\n<!-- flags-table:start -->\n{flags_table()}<!-- flags-table:end -->\nrest\n"


def test_every_option_has_help() -> None:
    for option in engine_options() + server_options():
        assert option.setting.help, ".".join(option.path)
    assert all(dataclasses.is_dataclass(o.type) for o in engine_options() if len(o.path) == 1)


@pytest.mark.parametrize("config, field, value", [
    ("ServerConfig", "port", 70000),
    ("ServerConfig", "max_waiting_requests", 0),
    ("ServerConfig", "max_request_body_bytes", 0),
    ("ServerConfig", "shutdown_grace_period_s", -1.0),
    ("ModelConfig", "device", "gpu"),
    ("ModelConfig", "max_model_len", 0),
    ("ModelConfig", "num_threads", -1),
    ("CacheConfig", "kv_cache_gb", float("nan")),
    ("CacheConfig", "kv_cache_gb", float("inf")),
    ("CacheConfig", "block_size", 16.0),
    ("SchedulerConfig", "max_num_seqs", "8"),
    ("StorageConfig", "redis_url", "localhost:6379"),  # refused by redis-py once the weights had loaded
    ("ModelConfig", "pull", True),  # without --model: ignored
    ("RouterConfig", "port", 70000),  # an OverflowError once every replica had been checked
    ("RouterConfig", "balance_rel_threshold", float("nan")),  # turned the load bound off
    ("RouterConfig", "replicas", ("http://host:abc",)),  # httpx's InvalidURL at the first contact
    ("RouterConfig", "replicas", ("http://",)),  # "did not answer" after the start-up timeout
    ("RouterConfig", "replicas", ("http://[::1",)),
    ("RouterConfig", "small_model", "qwen2.5-coder-0.5b"),  # ignored without --model-policy
    ("RouterConfig", "route_threshold", 0.5),
])
def test_a_value_that_would_fail_later_is_refused_by_name(config: str, field: str, value: object) -> None:
    """Refused when the configuration is made (before a model loads or a port is bound), naming the field;
    before, each was accepted and then ignored, refused every request, or raised something else later."""
    import kvserve.config
    import kvserve.serving_config

    module = kvserve.serving_config if config in ("ServerConfig", "RouterConfig") else kvserve.config
    with pytest.raises(ConfigError) as error:
        getattr(module, config)(**{field: value})
    assert error.value.param == field


def test_vllm_spellings_of_dtype_context_length_and_speculation_are_taken() -> None:
    """A vLLM command line's --dtype auto / half / float, --max-model-len 32k and a --speculative-config naming
    a draft model without its method were refused."""
    from kvserve.config import ModelConfig, speculative_config_from_json

    assert [ModelConfig(dtype=d).dtype for d in ("auto", "half", "float", "bfloat16")] == [
        "bfloat16", "float16", "float32", "bfloat16"]
    with pytest.raises(ConfigError, match="dtype must be one of"):
        ModelConfig(dtype="fp8")
    lengths = {text: engine_config_from_args(parse("serve", "--max-model-len", text)).model.max_model_len
               for text in ("4096", "32k", "32K", "25.6k", "1M", "1.001k")}
    assert lengths == {"4096": 4096, "32k": 32_000, "32K": 32_768, "25.6k": 25_600, "1M": 1 << 20,
                       "1.001k": 1_001}  # exact: as a float, 1.001 * 1000 is not whole
    for bad in ("1.5", "abc", "0.5k1"):
        with pytest.raises(SystemExit):
            parse("serve", "--max-model-len", bad)
    assert speculative_config_from_json('{"model": "qwen2.5-coder-0.5b"}').method == "draft_model"
    for spelling in ('"[ngram]"', '"ngram"'):
        ngram = speculative_config_from_json(f'{{"model": {spelling}, "prompt_lookup_max": 3}}')
        assert ngram.method == "ngram" and ngram.model is None
    assert speculative_config_from_json('{"model": "x", "method": null}').method == "draft_model"
    from kvserve.config import StorageConfig

    assert StorageConfig(redis_url="REDIS://127.0.0.1:6379/0").redis_url  # redis-py takes any case


@pytest.mark.parametrize("policy, threshold, message", [
    ("cascade", float("nan"), "route_threshold must be a finite number, got nan"),
    ("probe", 1.5, r"probe: --route-threshold is a probability, in \[0, 1\]"),
    ("gain", -2.0, r"gain: --route-threshold is a probability difference, in \[-1, 1\]"),
])
def test_a_route_threshold_outside_its_policys_range_is_refused(policy: str, threshold: float, message: str) -> None:
    from kvserve.serving_config import RouterConfig

    with pytest.raises(ConfigError, match=message):
        RouterConfig(model_policy=policy, small_model="a", large_model="b", probe_path="p", route_threshold=threshold)

