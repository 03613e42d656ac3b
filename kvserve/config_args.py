"""The CLI flags, the ``LLM(...)`` keywords and the flags table, generated from the config dataclasses.

An option is a field of one of EngineConfig's sub-configs (or a sub-config set whole, like ``speculative``),
or a field of ServerConfig for ``kvserve serve``; its ``Setting`` metadata (kvserve/config.py) gives its flag,
keyword and help. Nothing here names an option: a sub-config added to EngineConfig gets its flags and keywords
as it is. No torch here: the CLI builds its parser before it knows the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvserve.config import (
    DERIVED,
    SETTING,
    EngineConfig,
    Section,
    Setting,
    config_from_dict,
    duration_seconds,
    speculative_config_from_json,
)
from kvserve.errors import ConfigError
from kvserve.serving_config import RouterConfig, ServerConfig

SERVER_GROUP = "server"
ROUTER_GROUP = "router"


@dataclass(frozen=True, slots=True)
class Option:
    """One settable field. ``path`` is where it lives: ``("cache", "block_size")`` in EngineConfig,
    ``("speculative",)`` for a sub-config set whole, ``("port",)`` in ServerConfig."""

    path: tuple[str, ...]
    type: Any  # the field's type, resolved
    default: Any
    setting: Setting
    group: str

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str | None:
        flag = self.setting.flag
        return "--" + self.name.replace("_", "-") if flag == DERIVED else flag

    @property
    def keyword(self) -> str | None:
        keyword = self.setting.keyword
        return self.name if keyword == DERIVED else keyword

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value under (``--kv-retention`` -> ``kv_retention``)."""
        assert self.flag is not None
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def is_bool(self) -> bool:
        return _without_none(self.type) is bool


def engine_options() -> list[Option]:
    """Every EngineConfig option, in field order."""
    hints = typing.get_type_hints(EngineConfig)
    options: list[Option] = []
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata.get(SETTING, Section(f.name))
        if isinstance(meta, Setting):
            options.append(Option((f.name,), hints[f.name], _default(f), meta, f.name))
        else:
            options.extend(_field_options(hints[f.name], (f.name,), meta.group))
    return options


def server_options() -> list[Option]:
    """ServerConfig's options: flags of ``kvserve serve`` only."""
    return _field_options(ServerConfig, (), SERVER_GROUP)


def router_options() -> list[Option]:
    """RouterConfig's options: flags of ``kvserve route`` (``--replica`` is the CLI's own: it repeats)."""
    return _field_options(RouterConfig, (), ROUTER_GROUP)


def _field_options(cls: type, prefix: tuple[str, ...], group: str) -> list[Option]:
    hints = typing.get_type_hints(cls)
    return [Option((*prefix, f.name), hints[f.name], _default(f), f.metadata.get(SETTING, Setting()), group)
            for f in dataclasses.fields(cls)]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f.name
    return f.default_factory()


def _without_none(hint: Any) -> Any:
    """``int | None`` -> ``int``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


# --- argparse ------------------------------------------------------------------------------------------------
def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A Setting's parser as an argparse type: its ConfigError becomes argparse's usage error."""

    @functools.wraps(parse)
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ConfigError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


parse_duration = _argument_type(duration_seconds)
parse_speculative_config = _argument_type(speculative_config_from_json)


def _add_argument(group: argparse._ArgumentGroup, option: Option) -> None:
    assert option.flag is not None
    meaning = option.setting.help
    if option.default is not None:
        meaning += f" (default: {_default_text(option).strip('`')})"
    kwargs: dict[str, Any] = {"dest": option.dest, "default": option.default, "help": meaning.replace("%", "%%")}
    hint = _without_none(option.type)
    if option.setting.parse is not None:
        kwargs["type"] = _argument_type(option.setting.parse)
    elif hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(hint) is Literal:
        kwargs["choices"] = list(typing.get_args(hint))
    elif hint in (int, float, str):
        kwargs["type"] = hint
    elif hint == tuple[str, ...]:
        kwargs["type"], kwargs["nargs"] = str, "+"
    else:
        raise TypeError(f"{'.'.join(option.path)}: no flag for a {hint}; give its Setting a parse")
    if option.setting.metavar:
        kwargs["metavar"] = option.setting.metavar
    group.add_argument(option.flag, **kwargs)


def _add_arguments(parser: argparse.ArgumentParser, options: list[Option]) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        if option.flag is None:
            continue
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        _add_argument(groups[option.group], option)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options, spelled as vLLM spells them where the same option exists."""
    _add_arguments(parser, engine_options())


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    _add_arguments(parser, server_options())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return _engine_config({o.path: getattr(args, o.dest) for o in engine_options() if o.flag is not None})


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{o.name: getattr(args, o.dest) for o in server_options() if o.flag is not None})


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    _add_arguments(parser, router_options())


def router_config_from_args(args: argparse.Namespace, replicas: tuple[str, ...]) -> RouterConfig:
    return RouterConfig(replicas=replicas,
                        **{o.name: getattr(args, o.dest) for o in router_options() if o.flag is not None})


# --- LLM(...) keywords ---------------------------------------------------------------------------------------
def engine_config_from_keywords(keywords: Mapping[str, Any]) -> EngineConfig:
    """``LLM(...)``'s keywords: each names one option (``kv_host_gb``, ``scheduling_policy``, ...); a sub-config
    set whole (``speculative_config``) takes the dataclass, a dict of its fields or None."""
    by_keyword = {o.keyword: o for o in engine_options() if o.keyword is not None}
    unknown = sorted(set(keywords) - set(by_keyword))
    if unknown:
        raise ConfigError(f"unknown LLM keyword(s) {', '.join(unknown)}; valid keywords: "
                          f"{', '.join(sorted(by_keyword))}", unknown[0])
    return _engine_config({by_keyword[k].path: _keyword_value(by_keyword[k], v) for k, v in keywords.items()})


def _keyword_value(option: Option, value: Any) -> Any:
    if len(option.path) > 1 or not dataclasses.is_dataclass(option.type):
        return value
    if value is None:
        return option.default
    if isinstance(value, Mapping):
        return config_from_dict(option.type, value, option.name)
    if not isinstance(value, option.type):
        raise ConfigError(f"{option.keyword} must be a {option.type.__name__}, a dict of its fields or None, "
                          f"got {value!r}", option.keyword)
    return value


def _engine_config(values: Mapping[tuple[str, ...], Any]) -> EngineConfig:
    """EngineConfig from option values by path; options not given keep their defaults."""
    hints = typing.get_type_hints(EngineConfig)
    parts: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if (f.name,) in values:
            parts[f.name] = values[(f.name,)]
        else:
            parts[f.name] = hints[f.name](**{path[1]: v for path, v in values.items() if path[0] == f.name})
    return EngineConfig(**parts)


# --- the flags table -----------------------------------------------------------------------------------------
def flags_table() -> str:
    """A Markdown table of every option: flag, LLM keyword, default, help (the README carries it)."""
    lines = ["| flag | `LLM(...)` keyword | default | meaning |", "|---|---|---|---|"]
    for option in engine_options() + server_options():
        serve_only = option.group == SERVER_GROUP
        if option.flag is None:
            flag = "—"
        elif option.is_bool:
            flag = f"`{option.flag}` / `--no-{option.flag.removeprefix('--')}`"
        else:
            flag = f"`{option.flag}`"
        if option.setting.metavar:
            flag += f" {option.setting.metavar}"
        keyword = "— (serve only)" if serve_only or option.keyword is None else f"`{option.keyword}`"
        meaning = option.setting.help
        hint = _without_none(option.type)
        if typing.get_origin(hint) is Literal:
            meaning += f" (one of {', '.join(map(str, typing.get_args(hint)))})"
        cells = [flag, keyword, _default_text(option), meaning]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _default_text(option: Option) -> str:
    if option.setting.default_text is not None:
        return option.setting.default_text
    value = option.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "—"
    return f"`{value}`" if value != "" else '`""`'


def check_output_file(path: str | None, flag: str) -> None:
    """ConfigError naming ``flag`` unless a file can be written at ``path`` (None: nothing asked for): checked
    before a run whose results would otherwise be lost at its end."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: not a file that can be written (its directory must exist and be "
                          f"writable)", flag.removeprefix("--").replace("-", "_"))
