"""Build a `JobConfig` from defaults, a TOML file and `--section.key value` overrides.

Precedence is CLI > TOML > defaults. Every problem raises `ConfigError` naming the section, the
key, the offending value and the fix; nothing else escapes `load_job_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from config.checks import cross_check
from config.errors import ConfigError
from config.job_config import JobConfig

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _closest(name: str, options: typing.Iterable[str]) -> str:
    options = list(options)
    hint = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    guess = f"did you mean {hint[0]!r}? " if hint else ""
    return f"{guess}valid: {', '.join(options)}"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _sections() -> dict[str, type]:
    return {name: tp for name, tp in _hints(JobConfig).items()}


def _field_kind(where: str, value: object) -> str:
    return f"{where} = {value!r}"


def _coerce(value: Any, tp: Any, section: str, key: str, from_cli: bool) -> Any:
    """Return `value` converted to the annotation `tp`, or raise ConfigError."""
    where = f"[{section}] {key}"
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if from_cli and isinstance(value, str) and value.lower() in ("none", "null"):
            return None
        return _coerce(value, args[0], section, key, from_cli)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{_field_kind(where, value)}: not a valid choice; "
                f"{_closest(str(value), map(str, choices))}"
            )
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if from_cli:
            raise ConfigError(f"{where} cannot be set on the command line; set it in the TOML file")
        if not isinstance(value, list):
            raise ConfigError(f"{_field_kind(where, value)}: expected a TOML array of tables")
        return [_build(item, v, f"{section}.{key}[{i}]", False) for i, v in enumerate(value)]
    if tp is bool:
        if from_cli and isinstance(value, str):
            if value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
        elif isinstance(value, bool):
            return value
        raise ConfigError(f"{_field_kind(where, value)}: expected true or false")
    if tp is int:
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{_field_kind(where, value)}: expected an integer such as 10")
    if tp is float:
        number: float | None = None
        if from_cli and isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                pass
        if number is None:
            raise ConfigError(f"{_field_kind(where, value)}: expected a number such as 0.1")
        if not math.isfinite(number):
            raise ConfigError(f"{_field_kind(where, value)}: must be a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f'{_field_kind(where, value)}: expected a string such as "text"')
    raise ConfigError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover


def _check_bounds(field: dataclasses.Field, value: Any, where: str) -> None:
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    meta = field.metadata
    for op, ok, text in (
        ("ge", lambda b: value >= b, ">="),
        ("gt", lambda b: value > b, ">"),
        ("le", lambda b: value <= b, "<="),
        ("lt", lambda b: value < b, "<"),
    ):
        bound = meta.get(op)
        if bound is not None and not ok(bound):
            raise ConfigError(
                f"{_field_kind(where, value)}: out of range; use a value {text} {bound}"
            )


RETIRED = {
    ("mixed_precision", "compile"): "[optimizer] implementation = 'compiled' (one inductor "
    "graph a param group, under every container)",
}
"""Keys that are gone, and what replaced each: named in the refusal, not a close match."""


def _unknown(section: str, key: str, options: typing.Iterable[str], value: Any = None) -> str:
    """The refusal of `[section] key`: its replacement where it was retired, else the
    closest known key."""
    if (section, key) in RETIRED:
        given = "" if value is None else f" = {value!r}"
        return (
            f"[{section}] {key}{given}: retired; set {RETIRED[section, key]} instead, and "
            "leave this key out"
        )
    return f"[{section}] unknown key {key!r}; {_closest(key, options)}"


def _build(cls: type, values: Any, section: str, from_cli: bool) -> Any:
    """Instantiate the dataclass `cls` from a mapping of raw values."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] = {values!r}: expected a table of keys")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, raw in values.items():
        where = f"[{section}] {key}"
        if key not in fields:
            raise ConfigError(_unknown(section, key, fields, raw))
        kwargs[key] = _coerce(raw, hints[key], section, key, from_cli)
        _check_bounds(fields[key], kwargs[key], where)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in kwargs and required:
            raise ConfigError(f"[{section}] missing required key {name!r}; set it")
    return cls(**kwargs)


def _parse_cli(argv: list[str]) -> list[tuple[str, str, str]]:
    """Split argv into (section, key, raw value) triples; bare flags give "true"."""
    sections = _sections()
    out: list[tuple[str, str, str]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or "." not in token:
            raise ConfigError(
                f"unexpected argument {token!r}; overrides look like --section.key value "
                "(--help lists every key)"
            )
        name, eq, inline = token[2:].partition("=")
        section, _, key = name.partition(".")
        if section not in sections:
            raise ConfigError(
                f"unknown section [{section}] in {token!r}; {_closest(section, sections)}"
            )
        hints = _hints(sections[section])
        if key not in hints:
            raise ConfigError(_unknown(section, key, hints))
        if eq:
            value = inline
        elif hints[key] is bool:
            # A bare boolean flag means true; an explicit true/false after it is consumed.
            if i + 1 < len(argv) and argv[i + 1].lower() in _TRUE | _FALSE:
                value = argv[i + 1]
                i += 1
            else:
                value = "true"
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        else:
            raise ConfigError(f"[{section}] {key}: {token} needs a value, e.g. {token} VALUE")
        out.append((section, key, value))
        i += 1
    return out


def _read_toml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, or a NUL byte in the path.
        raise ConfigError(
            f"[job] config_file = {path!r}: cannot read it ({e}); pass an existing TOML file"
        ) from None
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as e:
        # TOMLDecodeError is a ValueError; tomllib also lets a plain ValueError (an integer
        # longer than int() accepts) and RecursionError (deeply nested arrays/tables) through.
        reason = "arrays or tables nested too deeply" if isinstance(e, RecursionError) else e
        raise ConfigError(
            f"[job] config_file = {path!r}: invalid TOML: {reason}; fix the file"
        ) from None


def load_job_config(argv: list[str] | None = None) -> JobConfig:
    """Return the job config for `argv` (`--job.config_file PATH` plus `--section.key value`)."""
    overrides = _parse_cli(list(argv or []))
    sections = _sections()
    # The last --job.config_file wins, as for every other key, so the file read is the one
    # recorded in `job.config_file`.
    files = [v for s, k, v in overrides if (s, k) == ("job", "config_file")]
    config_file = files[-1] if files else None
    doc = _read_toml(config_file) if config_file else {}
    for section in doc:
        if section not in sections:
            raise ConfigError(f"unknown section [{section}]; {_closest(section, sections)}")

    built: dict[str, Any] = {}
    for section, cls in sections.items():
        from_toml = _build(cls, doc.get(section, {}), section, False)
        cli = {k: v for s, k, v in overrides if s == section}
        if cli:
            # CLI strings are coerced on their own, then laid over the typed TOML values.
            typed = dataclasses.asdict(_build(cls, cli, section, True))
            kept = {f.name: getattr(from_toml, f.name) for f in dataclasses.fields(cls)}
            kept.update({k: typed[k] for k in cli})
            from_toml = cls(**kept)
        built[section] = from_toml
    cfg = JobConfig(**built)
    cross_check(cfg)
    return cfg
