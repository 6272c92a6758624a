"""Layered settings, the same for every ``tigana`` command: flags > ``TIGANA_*`` variables > a config file
(YAML or TOML) > the dataclass defaults.

A command's configuration is a frozen dataclass; ``load`` fills it from the four sources and remembers where
each value came from (``tigana config show --sources`` prints it). Values are converted by the field's type
hint (``int``, ``float``, ``bool``, ``str``, ``X | None``, ``tuple[str, ...]``) unless the command gives a
parser for the field (sizes such as ``8GiB``); a bad value raises the command's error type naming the field
and its source.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from tigana.ps.errors import InvalidArgument

__all__ = ["ENV_PREFIX", "Loaded", "describe_defaults", "load", "parse_bytes", "parse_metrics_port",
           "public_name", "read_file"]

ENV_PREFIX = "TIGANA_"
T = TypeVar("T")
Parser = Callable[[Any, str], Any]  # (raw value, "where it came from") -> the field's value


def public_name(field: str) -> str:
    """The one name a setting goes by in flags, file keys and ``TIGANA_*`` variables: the field without its
    unit suffix (``snapshot_every_s`` -> ``snapshot_every``: ``--snapshot-every``, ``snapshot-every:``,
    ``TIGANA_SNAPSHOT_EVERY``), as the flags have always been spelled. The field name itself is accepted too."""
    return field[:-2] if field.endswith("_s") else field


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """A configuration and, per field, where its value came from: ``default``, ``file PATH``,
    ``env TIGANA_X`` or ``flag --x``."""

    config: T
    sources: dict[str, str]

    def rows(self) -> list[tuple[str, Any, str]]:
        """(field, value, source): the config's own fields in order, then those it inherits (security)."""
        fields = dataclasses.fields(self.config)  # type: ignore[arg-type]
        own = set(vars(type(self.config)).get("__annotations__", {}))
        ordered = [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]
        return [(f.name, getattr(self.config, f.name), self.sources.get(f.name, "default")) for f in ordered]


def read_file(path: str | os.PathLike, fields: set[str], section: str | None = None,
              error: type[Exception] = InvalidArgument) -> dict[str, Any]:
    """Settings from a YAML (.yaml/.yml) or TOML (.toml) file: keys are field names (``-`` or ``_``); a
    top-level ``section:`` mapping, when present, is used instead of the whole file. Unknown keys are errors."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise error(f"config file {str(p)!r}: cannot read: {exc}") from None
    try:
        if p.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # noqa: BLE001 - any parser error is a user error here
        raise error(f"config file {str(p)!r}: cannot parse: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"config file {str(p)!r}: expected a mapping of settings")
    if section and isinstance(data.get(section), dict):
        data = data[section]
    accepted = {public_name(f): f for f in fields} | {f: f for f in fields}
    out = {}
    for key, value in data.items():
        name = str(key).strip().replace("-", "_").lower()
        if name not in accepted:
            raise error(f"config file {str(p)!r}: unknown field {key!r}; expected one of "
                        f"{sorted(public_name(f).replace('_', '-') for f in fields)}")
        out[accepted[name]] = value
    return out


def _convert(hint: Any, value: Any) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        empty = value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))
        if empty and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value)
    if value is None:
        raise ValueError("a value is required")
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, (list, tuple)):
            return tuple(str(v) for v in value)
        raise TypeError(type(value).__name__)
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(value)
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    return str(value)


def convert(cls: type, name: str, value: Any) -> Any:
    """``value`` (text of a flag, variable or file) as field ``name`` of the dataclass ``cls``, by its type hint."""
    return _convert(typing.get_type_hints(cls)[name], value)


def load(cls: type[T], *, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
         file: str | os.PathLike | None = None, section: str | None = None,
         parsers: Mapping[str, Parser] | None = None, env_prefixes: tuple[str, ...] = (ENV_PREFIX,),
         error: type[Exception] = InvalidArgument,
         derive: Callable[[dict[str, Any], dict[str, str]], None] | None = None) -> Loaded[T]:
    """``cls`` filled from ``flags`` (field -> value; None: not given) > environment variables (``PREFIX +
    FIELD``, the first of ``env_prefixes`` that is set wins) > ``file`` > defaults. ``derive(values, sources)``
    may fill fields no source gave (a StatefulSet identity). The dataclass checks the result."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    parsers = dict(parsers or {})

    def convert(name: str, value: Any, where: str) -> Any:
        try:
            if name in parsers:
                return parsers[name](value, where)
            return _convert(hints[name], value)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, error):
                raise
            raise error(f"{where}: field {name!r}: cannot read {value!r} as {hints[name]}") from None

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if file:
        for name, value in read_file(file, set(names), section, error).items():
            values[name], sources[name] = convert(name, value, f"config file {str(file)!r}"), f"file {file}"
    for name in names:
        spellings = dict.fromkeys((public_name(name).upper(), name.upper()))  # TIGANA_SNAPSHOT_EVERY first
        for var in (prefix + spelled for prefix in env_prefixes for spelled in spellings):
            raw = env.get(var)
            if raw is not None and raw != "":
                values[name], sources[name] = convert(name, raw, f"environment variable {var}"), f"env {var}"
                break
    for name, value in (flags or {}).items():
        if value is None:
            continue
        if name not in hints:
            raise error(f"flags: unknown field {name!r}")
        flag = f"--{public_name(name).replace('_', '-')}"
        values[name], sources[name] = convert(name, value, f"flag {flag}"), f"flag {flag}"
    if derive is not None:
        derive(values, sources)
    try:
        config = cls(**values)
    except error:
        raise
    except (TypeError, ValueError) as exc:
        raise error(str(exc)) from None
    return Loaded(config, {n: sources.get(n, "default") for n in names})


def describe_defaults(parser: argparse.ArgumentParser, cls: type, *, shown: Mapping[str, str] | None = None) -> None:
    """Append ``(default: X)`` to the help of every flag of ``parser`` whose destination is a field of ``cls``
    (flags default to None so that only given ones override the environment and the file; ``--help`` still
    shows the value a field takes when nothing sets it). ``shown`` overrides the text per field."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public iterator over actions
        name = action.dest
        if name not in defaults or action.help in (None, argparse.SUPPRESS) or "default" in action.help:
            continue
        value = (shown or {}).get(name, defaults[name])
        if value is None or value == ():
            value = "none"
        action.help = f"{action.help} (default: {value})"


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
    "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, *, field: str = "size") -> int:
    """``"8GiB"`` -> 8589934592. Binary units (KiB, MiB, GiB, TiB, or Ki/Mi/Gi/Ti), decimal ones (KB/K, MB/M,
    GB/G, TB/T) and plain byte counts; case-insensitive. Raises ``InvalidArgument`` naming ``field``."""
    if isinstance(text, bool):
        raise InvalidArgument(f"{field}: expected a size such as 8GiB, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
        if value < 0 or value != value:
            raise InvalidArgument(f"{field}: size must be >= 0, got {text!r}")
        return int(value)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidArgument(f"{field}: expected a size such as 8GiB, 512MiB or 1048576, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_metrics_port(value: Any, where: str) -> int:
    """A metrics port: a number (0: off) or ``auto``/``any`` (-1: any free port); ``where`` names the source."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "any"):
        return -1
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise InvalidArgument(f"{where}: field 'metrics_port': cannot read {value!r} as a port")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{where}: field 'metrics_port': cannot read {value!r} as a port") from None
