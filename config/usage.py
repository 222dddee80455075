"""`usage()`: every section and key of the job config with its type, default and docstring.

The text is generated from the dataclasses in `config.job_config` and the docstring under each
field, so `train.py --help` cannot drift from what the loader accepts.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import json
import textwrap
import types
import typing
from typing import Any, Literal

from config.job_config import JobConfig

__all__ = ["field_docs", "usage"]

_WIDTH = 96


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (whitespace folded)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(_toml(c) for c in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if origin is list:
        return "array of tables"
    return getattr(tp, "__name__", str(tp))


def _toml(value: Any) -> str:
    """`value` as a TOML file writes it (None: the key left unset)."""
    if isinstance(value, (bool, str)):
        return json.dumps(value)
    return repr(value)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _toml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _toml(f.default_factory())
    return "required"


def _keys(cls: type, title: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    lines = [title]
    for f in dataclasses.fields(cls):
        lines.append(f"  {f.name}: {_type_name(hints[f.name])} = {_default(f)}")
        lines += textwrap.wrap(
            docs.get(f.name, ""), _WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6
        )
    return lines


def usage(prog: str = "train.py") -> str:
    """The `--help` text of `prog`: how to set keys, then every section and key."""
    lines = [
        f"usage: {prog} [--nproc_per_node N] [--job.config_file FILE.toml] "
        "[--section.key VALUE ...]",
        "",
        "  --nproc_per_node N   start N ranks on this machine (gloo on CPU, nccl on GPUs) and",
        "                       stop them together: a signal reaches every rank, which saves and",
        "                       exits 0; without it, one process (or the ranks torchrun starts)",
        "",
        "Every key below is set in the TOML file ([section] key = value) or on the command",
        "line (--section.key VALUE or --section.key=VALUE; a boolean as a bare flag).",
        "Precedence: command line > TOML > the defaults shown, which run the debug job.",
    ]
    for section, cls in typing.get_type_hints(JobConfig).items():
        lines += ["", *_keys(cls, f"[{section}]")]
        for key, tp in typing.get_type_hints(cls).items():
            if typing.get_origin(tp) is list:  # an array of tables: list its tables' keys
                title = f"[[{section}.{key}]]  (TOML only; each table:)"
                lines += ["", *_keys(typing.get_args(tp)[0], title)]
    return "\n".join(lines) + "\n"
