"""Tests of `config.load_job_config`: defaults, TOML, CLI overrides and every `ConfigError`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import config
from config import ConfigError, JobConfig, ParamGroup, load_job_config


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _load(tmp_path: Path, text: str, *argv: str) -> JobConfig:
    return load_job_config(["--job.config_file", _write(tmp_path, text), *argv])


# --- Loading and precedence ----------------------------------------------------------------


def test_defaults_without_argv():
    """No argv gives the dataclass defaults."""
    assert load_job_config() == JobConfig()
    assert load_job_config([]) == JobConfig()


def test_toml_overrides_defaults(tmp_path):
    """TOML values replace defaults; untouched keys and sections keep them."""
    cfg = _load(
        tmp_path,
        """
        [optimizer]
        lr = 0.01
        implementation = "fused"

        [training]
        steps = 70
        dataset = "other"

        [checkpoint]
        enable = true
        """,
    )
    assert cfg.optimizer.lr == 0.01
    assert cfg.optimizer.implementation == "fused"
    assert cfg.optimizer.beta1 == 0.9
    assert cfg.training.steps == 70
    assert cfg.training.dataset == "other"
    assert cfg.checkpoint.enable is True
    assert cfg.model == config.Model()
    assert cfg.job.config_file == str(tmp_path / "job.toml")


@pytest.mark.parametrize("form", ["space", "equals"])
def test_cli_overrides_toml(tmp_path, form):
    """`--a.b v` and `--a.b=v` both beat the TOML value; other TOML keys survive."""
    overrides = {"optimizer.lr": "0.5", "training.steps": "30", "model.flavor": "big"}
    argv = []
    for name, value in overrides.items():
        argv += [f"--{name}", value] if form == "space" else [f"--{name}={value}"]
    cfg = _load(
        tmp_path,
        "[optimizer]\nlr = 0.01\nbeta1 = 0.8\n[training]\nsteps = 70\nseed = 4\n",
        *argv,
    )
    assert cfg.optimizer.lr == 0.5
    assert cfg.optimizer.beta1 == 0.8
    assert cfg.training.steps == 30
    assert cfg.training.seed == 4
    assert cfg.model.flavor == "big"


def test_cli_without_toml():
    """Overrides apply over defaults when no config file is given."""
    cfg = load_job_config(["--training.steps", "50", "--optimizer.name=SGD"])
    assert cfg.training.steps == 50
    assert cfg.optimizer.name == "SGD"
    assert cfg.job.config_file is None


def test_later_cli_override_wins():
    """A key given twice on the CLI takes the last value."""
    assert load_job_config(["--training.steps", "50", "--training.steps=60"]).training.steps == 60


def test_last_config_file_is_read_and_recorded(tmp_path):
    """With `--job.config_file` given twice, the file read is the one recorded."""
    first = tmp_path / "first.toml"
    second = tmp_path / "second.toml"
    first.write_text("[training]\nsteps = 10\n", encoding="utf-8")
    second.write_text("[training]\nsteps = 20\n", encoding="utf-8")
    cfg = load_job_config(["--job.config_file", str(first), "--job.config_file", str(second)])
    assert cfg.job.config_file == str(second)
    assert cfg.training.steps == 20


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable", "true"], True),
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable", "FALSE"], False),
        (["--checkpoint.enable", "0"], False),
        (["--checkpoint.enable=false"], False),
        (["--checkpoint.enable=on"], True),
        (["--checkpoint.enable", "--training.steps", "50"], True),
    ],
)
def test_cli_bool_flags(argv, expected):
    """A bare bool flag means true; an explicit true/false after it is honoured."""
    assert load_job_config(argv).checkpoint.enable is expected


def test_cli_bare_flag_overrides_toml_false(tmp_path):
    """`--checkpoint.enable false` beats a TOML true, and a bare flag beats a TOML false."""
    off = _load(tmp_path, "[checkpoint]\nenable = true\n", "--checkpoint.enable", "false")
    on = _load(tmp_path, "[checkpoint]\nenable = false\n", "--checkpoint.enable")
    assert off.checkpoint.enable is False
    assert on.checkpoint.enable is True


def test_int_accepted_for_float(tmp_path):
    """TOML ints become floats in float fields."""
    cfg = _load(tmp_path, "[optimizer]\nlr = 1\nweight_decay = 0\n")
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)


@pytest.mark.parametrize(("value", "expected"), [("none", None), ("None", None), ("0.5", 0.5)])
def test_optional_float_from_cli(tmp_path, value, expected):
    """`none` clears an optional float even when the TOML set it."""
    cfg = _load(
        tmp_path, "[lr_scheduler]\ndecay_ratio = 0.2\n", "--lr_scheduler.decay_ratio", value
    )
    assert cfg.lr_scheduler.decay_ratio == expected


def test_negative_cli_value_is_a_value():
    """A value starting with a single dash is consumed as the value."""
    assert load_job_config(["--checkpoint.load_step", "-1"]).checkpoint.load_step == -1


# --- Param groups --------------------------------------------------------------------------


def test_param_groups_parse(tmp_path):
    """`[[optimizer.param_groups]]` gives ParamGroup objects with unset fields None."""
    cfg = _load(
        tmp_path,
        """
        [optimizer]
        lr = 0.01

        [[optimizer.param_groups]]
        pattern = "bias|norm"
        weight_decay = 0

        [[optimizer.param_groups]]
        pattern = "embed"
        name = "SGD"
        lr = 0.1
        beta1 = 0.5
        beta2 = 0.6
        eps = 1e-6
        """,
    )
    assert cfg.optimizer.param_groups == [
        ParamGroup(pattern="bias|norm", weight_decay=0.0),
        ParamGroup(pattern="embed", name="SGD", lr=0.1, beta1=0.5, beta2=0.6, eps=1e-6),
    ]
    first = cfg.optimizer.param_groups[0]
    assert first.name is None and first.lr is None and first.eps is None
    assert isinstance(first.weight_decay, float)


def test_matrix_optimizer_keys_parse_in_optimizer_and_groups(tmp_path):
    """Muon's and Adafactor's keys under `[optimizer]` and per group; momentum and nesterov
    unset stay None (the optimizer's own default), so Muon keeps its momentum."""
    cfg = _load(
        tmp_path,
        r"""
        [optimizer]
        name = "Adafactor"
        beta2_decay = -0.5
        d = 2
        eps1 = 1e-30
        eps2 = 0.01

        [[optimizer.param_groups]]
        pattern = 'layers\..*\.(attention|feed_forward)\..*weight'
        name = "Muon"
        momentum = 0.9
        nesterov = false
        ns_steps = 3
        adjust_lr_fn = "match_rms_adamw"
        """,
        "--optimizer.eps1",
        "none",
    )
    opt = cfg.optimizer
    assert (opt.beta2_decay, opt.d, opt.eps1, opt.eps2) == (-0.5, 2.0, None, 0.01)
    assert opt.momentum is None and opt.nesterov is None and opt.ns_steps == 5
    assert opt.param_groups == [
        ParamGroup(
            pattern=r"layers\..*\.(attention|feed_forward)\..*weight",
            name="Muon",
            momentum=0.9,
            nesterov=False,
            ns_steps=3,
            adjust_lr_fn="match_rms_adamw",
        )
    ]
    with pytest.raises(ConfigError, match=r"adjust_lr_fn = 'match_rms': .*mean 'match_rms_adamw'"):
        _load(tmp_path, '[optimizer]\nadjust_lr_fn = "match_rms"\n')
    with pytest.raises(ConfigError, match=r"ns_steps = 100: out of range; use a value < 100"):
        _load(tmp_path, "[[optimizer.param_groups]]\npattern = 'a'\nns_steps = 100\n")
    with pytest.raises(ConfigError, match=r"beta2_decay = 0\.5: out of range; use a value <= 0"):
        _load(tmp_path, "[optimizer]\nbeta2_decay = 0.5\n")


def test_param_groups_survive_cli_override(tmp_path):
    """A CLI override of another optimizer key keeps the TOML param groups."""
    cfg = _load(
        tmp_path,
        '[[optimizer.param_groups]]\npattern = "bias"\nlr = 0.2\n',
        "--optimizer.lr",
        "0.3",
    )
    assert cfg.optimizer.lr == 0.3
    assert cfg.optimizer.param_groups == [ParamGroup(pattern="bias", lr=0.2)]


def test_param_groups_inline_array(tmp_path):
    """An inline array of tables works the same as `[[...]]`."""
    cfg = _load(tmp_path, '[optimizer]\nparam_groups = [{ pattern = "x" }]\n')
    assert cfg.optimizer.param_groups == [ParamGroup(pattern="x")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[[optimizer.param_groups]]\nlr = 0.1\n",
            r"\[optimizer\.param_groups\[0\]\] missing required key 'pattern'",
        ),
        (
            '[[optimizer.param_groups]]\npattern = "a"\n[[optimizer.param_groups]]\nlr = 0.1\n',
            r"\[optimizer\.param_groups\[1\]\] missing required key 'pattern'",
        ),
        (
            '[[optimizer.param_groups]]\npattern = "a"\nlr = -1\n',
            r"\[optimizer\.param_groups\[0\]\] lr = -1\.0: out of range; use a value > 0\.0",
        ),
        (
            '[[optimizer.param_groups]]\npattern = "a"\nbeta2 = "high"\n',
            r"\[optimizer\.param_groups\[0\]\] beta2 = 'high': expected a number",
        ),
        (
            "[[optimizer.param_groups]]\npattern = 3\n",
            r"\[optimizer\.param_groups\[0\]\] pattern = 3: expected a string",
        ),
        (
            '[[optimizer.param_groups]]\npattern = "a"\nwd = 0\n',
            r"\[optimizer\.param_groups\[0\]\] unknown key 'wd'",
        ),
        (
            "[optimizer]\nparam_groups = [1]\n",
            r"\[optimizer\.param_groups\[0\]\] = 1: expected a table of keys",
        ),
        (
            '[optimizer]\nparam_groups = "bias"\n',
            r"\[optimizer\] param_groups = 'bias': expected a TOML array of tables",
        ),
    ],
)
def test_param_group_errors(tmp_path, text, message):
    """Errors inside a group name `optimizer.param_groups[i]` and the key."""
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, text)


# --- Errors --------------------------------------------------------------------------------

TOML_ERRORS = [
    # Unknown names, with a suggestion.
    ("[optimzer]\nlr = 0.1\n", r"unknown section \[optimzer\]; did you mean 'optimizer'\?"),
    ("[optimizer]\nlrr = 0.1\n", r"\[optimizer\] unknown key 'lrr'; did you mean 'lr'\?"),
    ("[training]\nstep = 5\n", r"\[training\] unknown key 'step'; did you mean 'steps'\?"),
    # A retired key, with what replaced it.
    (
        "[mixed_precision]\ncompile = true\n",
        r"\[mixed_precision\] compile = True: retired; set \[optimizer\] implementation = "
        r"'compiled' .* instead",
    ),
    ("[zzzz]\n", r"unknown section \[zzzz\]; valid: job, model, parallelism, optimizer"),
    # Wrong types.
    ('[training]\nsteps = "ten"\n', r"\[training\] steps = 'ten': expected an integer"),
    ("[training]\nsteps = true\n", r"\[training\] steps = True: expected an integer"),
    ("[training]\nsteps = 1.5\n", r"\[training\] steps = 1\.5: expected an integer"),
    ("[optimizer]\nname = 3\n", r"\[optimizer\] name = 3: expected a string"),
    ("[optimizer]\nlr = { a = 1 }\n", r"\[optimizer\] lr = \{'a': 1\}: expected a number"),
    ("[optimizer]\nlr = [0.1]\n", r"\[optimizer\] lr = \[0\.1\]: expected a number"),
    ("[optimizer]\nlr = true\n", r"\[optimizer\] lr = True: expected a number"),
    ('[checkpoint]\nenable = "yes"\n', r"\[checkpoint\] enable = 'yes': expected true or false"),
    ("[checkpoint]\nenable = 1\n", r"\[checkpoint\] enable = 1: expected true or false"),
    ("training = 5\n", r"\[training\] = 5: expected a table of keys"),
    (f"[optimizer]\nlr = {10**400}\n", r"\[optimizer\] lr = 1000+: expected a number"),
    # Out of range.
    ("[training]\nsteps = 0\n", r"\[training\] steps = 0: out of range; use a value >= 1"),
    ("[optimizer]\nlr = -0.1\n", r"\[optimizer\] lr = -0\.1: out of range; use a value > 0"),
    ("[optimizer]\nbeta1 = 1.0\n", r"\[optimizer\] beta1 = 1\.0: out of range; use a value < 1"),
    ("[optimizer]\nbeta2 = -0.1\n", r"\[optimizer\] beta2 = -0\.1: out of range; use a value >="),
    ("[optimizer]\neps = 0\n", r"\[optimizer\] eps = 0\.0: out of range; use a value > 0"),
    ("[optimizer]\nweight_decay = -1\n", r"\[optimizer\] weight_decay = -1\.0: out of range"),
    ("[training]\nmax_norm = -1\n", r"\[training\] max_norm = -1\.0: out of range; use a value >="),
    ("[lr_scheduler]\ndecay_ratio = 1.5\n", r"\[lr_scheduler\] decay_ratio = 1\.5: .* <= 1"),
    ("[checkpoint]\nload_step = -2\n", r"\[checkpoint\] load_step = -2: .* >= -1"),
    ("[mixed_precision]\ngrowth_factor = 1\n", r"growth_factor = 1\.0: out of range; .* > 1"),
    # Non-finite floats.
    ("[optimizer]\nlr = nan\n", r"\[optimizer\] lr = nan: must be a finite number"),
    ("[training]\nmax_norm = inf\n", r"\[training\] max_norm = inf: must be a finite number"),
    ("[optimizer]\neps = -inf\n", r"\[optimizer\] eps = -inf: must be a finite number"),
    # Literal choices.
    (
        '[optimizer]\nimplementation = "fusd"\n',
        r"\[optimizer\] implementation = 'fusd': not a valid choice; did you mean 'fused'\?",
    ),
    ("[lr_scheduler]\ndecay_type = 2\n", r"\[lr_scheduler\] decay_type = 2: not a valid choice"),
    # Cross-field check.
    (
        "[mixed_precision]\ninitial_scale = 0.5\n",
        r"\[mixed_precision\] initial_scale = 0\.5: must lie within min_scale = 1\.0",
    ),
    (
        "[mixed_precision]\nmax_scale = 1024\n",
        r"\[mixed_precision\] initial_scale = 65536\.0: .* max_scale = 1024\.0",
    ),
]


@pytest.mark.parametrize(("text", "message"), TOML_ERRORS)
def test_toml_errors(tmp_path, text, message):
    """Each bad TOML value raises ConfigError naming section, key and value."""
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, text)


CLI_ERRORS = [
    # Unknown names.
    (["--trainig.steps", "5"], r"unknown section \[trainig\].*did you mean 'training'\?"),
    (["--training.step", "5"], r"\[training\] unknown key 'step'; did you mean 'steps'\?"),
    (["--optimizer.lrr=0.1"], r"\[optimizer\] unknown key 'lrr'; did you mean 'lr'\?"),
    (["--training=5"], r"unexpected argument '--training=5'"),
    (
        ["--mixed_precision.compile", "true"],
        r"\[mixed_precision\] compile: retired; set \[optimizer\] implementation = 'compiled'",
    ),
    (["--training=a.b"], r"\[training\] unknown key ''"),
    # Wrong types.
    (["--training.steps", "ten"], r"\[training\] steps = 'ten': expected an integer"),
    (["--training.steps", "1.5"], r"\[training\] steps = '1\.5': expected an integer"),
    (["--optimizer.lr", "fast"], r"\[optimizer\] lr = 'fast': expected a number"),
    (["--checkpoint.enable=maybe"], r"\[checkpoint\] enable = 'maybe': expected true or false"),
    # Out of range.
    (["--training.steps", "-1"], r"\[training\] steps = -1: out of range; use a value >= 1"),
    (["--optimizer.lr=-0.1"], r"\[optimizer\] lr = -0\.1: out of range; use a value > 0"),
    (["--optimizer.beta1", "1"], r"\[optimizer\] beta1 = 1\.0: out of range; use a value < 1"),
    # Non-finite floats.
    (["--optimizer.lr", "inf"], r"\[optimizer\] lr = 'inf': must be a finite number"),
    (["--training.max_norm=nan"], r"\[training\] max_norm = 'nan': must be a finite number"),
    (["--optimizer.lr", "1e999"], r"\[optimizer\] lr = '1e999': must be a finite number"),
    # Literal choices.
    (
        ["--optimizer.implementation", "fusd"],
        r"\[optimizer\] implementation = 'fusd': not a valid choice; did you mean 'fused'\?",
    ),
    # Malformed argv.
    (["--training.steps"], r"\[training\] steps: --training\.steps needs a value"),
    (
        ["--training.steps", "--optimizer.lr", "0.1"],
        r"\[training\] steps: --training\.steps needs a value",
    ),
    (["foo"], r"unexpected argument 'foo'; overrides look like --section\.key value"),
    (["--training.steps", "5", "6"], r"unexpected argument '6'"),
    (["--checkpoint.enable", "maybe"], r"unexpected argument 'maybe'"),
    (["--training"], r"unexpected argument '--training'"),
    (["-x.y"], r"unexpected argument '-x\.y'"),
    (
        ["--optimizer.param_groups", "x"],
        r"\[optimizer\] param_groups cannot be set on the command line; set it in the TOML",
    ),
    (["--optimizer.param_groups=[]"], r"\[optimizer\] param_groups cannot be set on the command"),
    # Cross-field check.
    (["--mixed_precision.min_scale=1e6"], r"\[mixed_precision\] initial_scale = 65536\.0"),
    (
        [
            "--fault_tolerance.enable",
            "--fault_tolerance.semi_sync_method=diloco",
            "--fault_tolerance.sync_steps=4",
            "--fault_tolerance.num_fragments=2",
            "--fault_tolerance.fragment_sync_delay=2",
        ],
        r"fragment_sync_delay = 2: a fragment's average must land before the next .*"
        r"use at most 1",
    ),
    (
        ["--mixed_precision.param_dtype", "float16"],
        r"\[mixed_precision\] param_dtype = 'float16': only \[optimizer\] container = "
        r"'mixed_precision' reads it, and container = 'default'; set",
    ),
    # A key of a feature that is off (issue 47): refused unless at its default.
    (
        ["--ema.half_life", "8"],
        r"\[ema\] half_life = 8\.0: only \[ema\] enable = true reads it, and enable = false; "
        r"set \[ema\] enable = true or remove \[ema\] half_life \(with the feature off, only "
        r"its default 0\.0 is accepted\)$",
    ),
    (
        ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"],
        r"^\[fault_tolerance\] semi_sync_method = 'diloco': only \[fault_tolerance\] enable = "
        r"true reads it",
    ),
    (
        ["--checkpoint.load_step", "4"],
        r"^\[checkpoint\] load_step = 4: only \[checkpoint\] enable = true reads it",
    ),
    # Missing or unreadable file.
    (["--job.config_file", "/nonexistent/job.toml"], r"config_file = '/nonexistent/job\.toml'"),
    (["--job.config_file", "/"], r"\[job\] config_file = '/': cannot read it"),
    (["--job.config_file=a\x00b"], r"\[job\] config_file = 'a\\x00b': cannot read it"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_ERRORS)
def test_cli_errors(argv, message):
    """Each bad CLI override raises ConfigError naming section, key and value."""
    with pytest.raises(ConfigError, match=message):
        load_job_config(argv)


def test_a_feature_that_is_off_takes_its_defaults_and_where_it_connects_or_saves(tmp_path):
    """TOMLs spell defaults out, and a TOML's torchft or checkpoints are switched off from
    the command line (scripts/convert.py does): neither is refused (issue 47)."""
    text = (
        '[ema]\ndecay = 0.9999\nexport = false\n[mixed_precision]\nparam_dtype = "bfloat16"\n'
        '[fault_tolerance]\nsync_steps = 100\nouter_optimizer = "SGD"\nlighthouse = "http://h:1"\n'
        "connect_timeout_ms = 5\n[checkpoint]\nenable = true\ninterval = 7\n"
    )
    cfg = _load(tmp_path, text, "--checkpoint.enable", "false")
    assert cfg.ema.decay == 0.9999 and cfg.checkpoint.interval == 7
    with pytest.raises(ConfigError, match=r"^\[checkpoint\] load_step = 3: only"):
        _load(tmp_path, text + "load_step = 3\n", "--checkpoint.enable", "false")


def test_config_error_is_value_error():
    """ConfigError is a ValueError so generic handlers still catch it."""
    assert issubclass(ConfigError, ValueError)


def test_missing_config_file(tmp_path):
    """A missing file names the path and asks for an existing one."""
    path = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=r"cannot read it .*pass an existing TOML file") as info:
        load_job_config(["--job.config_file", str(path)])
    assert str(path) in str(info.value)
    assert info.value.__cause__ is None


def test_non_utf8_config_file(tmp_path):
    """A file that is not UTF-8 is a ConfigError, not a UnicodeDecodeError."""
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[job]\ndump_folder = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"\[job\] config_file = .*cannot read it"):
        load_job_config(["--job.config_file", str(path)])


def test_invalid_toml_names_the_line(tmp_path):
    """A syntax error in the middle of the file reports its line."""
    text = "[training]\nsteps = 5\nseed 4\ndataset = 'x'\n"
    with pytest.raises(ConfigError, match=r"invalid TOML: .*line 3.*; fix the file"):
        _load(tmp_path, text)


@pytest.mark.parametrize(
    "text",
    [
        "[training]\nsteps = 5\nsteps = 6\n",
        "[training]\nsteps = \n",
        "[training\n",
        "x = " + "[" * 5000 + "]" * 5000 + "\n",
        "x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
        "x = " + "1" * 5000 + "\n",
    ],
    ids=["duplicate-key", "no-value", "unclosed-header", "deep-array", "deep-table", "huge-int"],
)
def test_invalid_toml(tmp_path, text):
    """Anything tomllib rejects, deep nesting and huge integers included, is a ConfigError."""
    with pytest.raises(ConfigError, match=r"\[job\] config_file = .*invalid TOML: .*fix the file"):
        _load(tmp_path, text)


# --- Property tests ------------------------------------------------------------------------

_HINTS = typing.get_type_hints(JobConfig)
SECTION_CLASSES: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(JobConfig)}
FIELDS: dict[str, list[str]] = {
    name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTION_CLASSES.items()
}
GROUP_FIELDS = [f.name for f in dataclasses.fields(ParamGroup)]
ALL_FIELDS = sorted({k for keys in FIELDS.values() for k in keys} | set(GROUP_FIELDS))
CHOICES = sorted(
    {
        str(choice)
        for cls in SECTION_CLASSES.values()
        for tp in typing.get_type_hints(cls).values()
        if typing.get_origin(tp) is typing.Literal
        for choice in typing.get_args(tp)
    }
)

names = st.text(max_size=8)


def _mostly(options: list[str]) -> st.SearchStrategy[str]:
    """One of `options`, or now and then a random name."""
    return st.sampled_from([*options, None]).flatmap(lambda o: names if o is None else st.just(o))


section_names = _mostly(sorted(SECTION_CLASSES))
section_keys = {name: _mostly(keys) for name, keys in FIELDS.items()}
any_keys = st.sampled_from(ALL_FIELDS) | names
scalars = st.one_of(
    st.integers(min_value=-2, max_value=100),
    st.floats(min_value=0.0, max_value=1.0),
    st.sampled_from(CHOICES),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_keys, inner, max_size=3),
    max_leaves=4,
)
param_groups = st.lists(
    st.dictionaries(st.sampled_from(GROUP_FIELDS) | names, scalars, max_size=4), max_size=3
)


@st.composite
def sections(draw: st.DrawFn) -> tuple[str, Any]:
    """A (name, table) pair: a real or random section with real or random keys."""
    name = draw(section_names)
    if draw(st.integers(0, 19)) == 0:
        return name, draw(values)  # A scalar or array where a table belongs.
    table = draw(st.dictionaries(section_keys.get(name, any_keys), values, max_size=4))
    if name == "optimizer" and draw(st.booleans()):
        table["param_groups"] = draw(param_groups)
    return name, table


documents = st.lists(sections(), max_size=4).map(dict)


def _quote(text: str) -> str:
    # JSON strings are TOML basic strings, except that TOML also forbids a raw DEL.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(v: Any) -> str:
    """`v` as an inline TOML value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _quote(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return "{ " + ", ".join(f"{_quote(k)} = {_value(x)}" for k, x in v.items()) + " }"


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def to_toml(doc: dict[str, Any], table_arrays: bool) -> str:
    """Serialize `doc`; lists of tables become `[[section.key]]` blocks if `table_arrays`."""
    lines = [f"{_quote(name)} = {_value(v)}" for name, v in doc.items() if not isinstance(v, dict)]
    for name, table in doc.items():
        if not isinstance(table, dict):
            continue
        lines.append(f"[{_quote(name)}]")
        arrays = {}
        for key, v in table.items():
            if table_arrays and _is_table_array(v):
                arrays[key] = v
            else:
                lines.append(f"{_quote(key)} = {_value(v)}")
        for key, items in arrays.items():
            for item in items:
                lines.append(f"[[{_quote(name)}.{_quote(key)}]]")
                lines.extend(f"{_quote(k)} = {_value(x)}" for k, x in item.items())
    return "\n".join(lines) + "\n"


cli_values = st.one_of(
    st.sampled_from(["true", "false", "none", "nan", "inf", "-1", "0", "1e999", "0.5"]),
    st.sampled_from(CHOICES),
    st.integers().map(str),
    st.floats().map(repr),
    st.text(max_size=8),
)
token_kinds = st.sampled_from(["flag-value", "equals", "flag-value", "equals", "flag", "stray"])


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    """CLI tokens: real and random `--section.key`, `=value` forms, values and stray tokens."""
    tokens: list[str] = []
    for _ in range(draw(st.integers(0, 4))):
        section = draw(section_names)
        flag = f"--{section}.{draw(section_keys.get(section, any_keys))}"
        kind = draw(token_kinds)
        if kind == "flag-value":
            tokens += [flag, draw(cli_values)]
        elif kind == "equals":
            tokens.append(f"{flag}={draw(cli_values)}")
        elif kind == "flag":
            tokens.append(flag)
        else:
            tokens.append(draw(cli_values))
    return tokens


def _load_or_config_error(text: str, argv: list[str]) -> str | None:
    """Load `text` as the TOML file with `argv`; return the ConfigError message, if any.

    Any exception other than ConfigError fails the test.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "generated.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            cfg = load_job_config(["--job.config_file", path, *argv])
        except ConfigError as e:
            event("ConfigError")
            assert str(e)
            return str(e)
    event("JobConfig")
    assert isinstance(cfg, JobConfig)
    return None


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300), argv=overrides())
def test_arbitrary_text_never_escapes(text, argv):
    """Arbitrary text as the TOML file gives a JobConfig or a ConfigError, nothing else."""
    _load_or_config_error(text, argv)


@settings(max_examples=300, deadline=None)
@given(doc=documents, table_arrays=st.booleans(), argv=overrides())
def test_structured_toml_never_escapes(doc, table_arrays, argv):
    """Structured TOML of real and random names gives a JobConfig or a ConfigError."""
    message = _load_or_config_error(to_toml(doc, table_arrays), argv)
    # The serializer writes valid TOML, so the loader, not the parser, must judge it.
    assert message is None or "generated.toml': invalid TOML" not in message


@pytest.mark.parametrize(
    "doc",
    [
        {"training": {"steps": 50, "max_norm": 0.5}, "checkpoint": {"enable": True}},
        {"optimizer": {"lr": 1, "param_groups": [{"pattern": "a", "lr": 0.5}, {"pattern": "b"}]}},
        {"job": {"dump_folder": 'quote " back \\ del \x7f tab \t nl \n'}},
    ],
)
@pytest.mark.parametrize("table_arrays", [False, True])
def test_serializer_round_trips(tmp_path, doc, table_arrays):
    """The test's own TOML serializer produces documents the loader reads back."""
    cfg = _load(tmp_path, to_toml(doc, table_arrays))
    for section, table in doc.items():
        for key, value in table.items():
            got = getattr(getattr(cfg, section), key)
            if key == "param_groups":
                got = [{k: v for k, v in vars(g).items() if v is not None} for g in got]
            assert got == value
