"""The user docs (README.md, docs/*.md) say only what runs.

Static checks (no process started): every fenced bash/sh/console command names files, modules,
programs and flags that exist (a `--section.key` is a field of a config dataclass, and every
train.py command's arguments load through `config.load_job_config`; other flags appear in the
script that takes them); commands call Python one way (`.venv/bin/...`), give each run its own
dump folder and end whatever they start in the background; every TOML block's sections and
keys exist; every Python block compiles, and one marked `<!-- file: PATH -->` is that file;
paths and links in the text exist; README's test command is `.ci/run`'s; README.md and
benchmarks/README.md stay within 300 lines; no development history (issue numbers, commit
hashes, "today's", "found and fixed") in the user docs or in the docstrings of `containers/`.

The blocks marked `<!-- ci -->` run, as written, in a copy of the checkout made of symlinks
(so their `outputs/` stay out of the repository): the Python blocks in one process, then the
bash blocks; each marked block is short (a few training steps, one process or two).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
USER_TEXT = [*DOCS, ROOT / "benchmarks" / "README.md", ROOT / "ARCHITECTURE.md"]
VENV_BIN = Path(sys.executable).parent
SHELLS = {"bash", "sh", "console"}

# Development history that has no place in user text.
HISTORY = [
    re.compile(r"\bissues?\s+#?\d+", re.I),
    re.compile(r"(?<![\w&/])#\d+\b"),
    re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    re.compile(r"\btoday'?s?\b", re.I),
    re.compile(r"\bfound and fixed\b", re.I),
    re.compile(r"\bsession \d+\b", re.I),
]


@dataclasses.dataclass
class Block:
    path: Path
    line: int
    lang: str
    body: str
    mark: str  # the HTML comment right above the fence ("ci", "file: PATH"), or ""

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, each with the comment that marks it."""
    found, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = re.fullmatch(r"<!--\s*(.*?)\s*-->", before.strip())
        body = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(path, i + 1, fence[1], body, mark[1] if mark else ""))
        i = end + 1
    return found


ALL = [b for p in DOCS for b in blocks(p)]
SHELL_BLOCKS = [b for b in ALL if b.lang in SHELLS]


@dataclasses.dataclass
class Command:
    words: list[str]
    then: str  # the operator after it: ";", "&&", "||", "&", "|" or ""


def commands(body: str) -> list[Command]:
    """The simple commands of a shell block, variables of the block expanded (a loop
    variable takes its first value), keywords and environment assignments dropped."""
    text = re.sub(r"\\\n", " ", body)
    found: list[Command] = []
    variables: dict[str, str] = {}
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token not in (";", "&&", "||", "&", "|", ";;"):
                words.append(token)
                continue
            while words and words[0] in ("do", "done", "then", "fi", "else", "{", "}"):
                words.pop(0)
            while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
                name, _, value = words.pop(0).partition("=")
                if not words:
                    variables[name] = value
            if words and words[0] == "for":
                variables[words[1]] = words[3]
            elif words:
                expanded = []
                for w in words:
                    if w.startswith("$") and w[1:] in variables:
                        expanded += variables[w[1:]].split()
                    else:
                        expanded.append(w)
                found.append(Command(expanded, token))
            words = []
    return found


def _sections() -> dict[str, type]:
    from config import JobConfig

    return typing.get_type_hints(JobConfig)


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def check_config_flag(flag: str) -> str | None:
    section, _, key = flag[2:].partition("=")[0].partition(".")
    sections = _sections()
    if section not in sections:
        return f"{flag}: no section [{section}]"
    if key not in _fields(sections[section]):
        return f"{flag}: [{section}] has no key {key!r}"
    return None


def _repo_path(word: str) -> Path | None:
    """The repository path a word names, if it names one (outputs are the commands' own)."""
    first = word.split("/")[0]
    if "/" in word and (ROOT / first).exists() and first not in ("outputs", ".venv"):
        return ROOT / word
    return None


# Flags of programs that are not ours, as the docs use them.
EXTERNAL_FLAGS = {
    "torchrun": {"--standalone", "--nproc_per_node"},
    "torchft_lighthouse": {"--bind", "--min_replicas", "--heartbeat_timeout_ms"},
}
EXTERNAL_MODULES = {"pytest", "pip", "venv"}


def problems(cmd: Command) -> list[str]:
    """What a command names that does not exist, or calls in another way than the docs'."""
    out: list[str] = []
    words = cmd.words
    prog = words[0]
    if prog in ("wait", "kill", "echo", "cd", "mkdir", "rm", "ls", "cat", "sleep", "export"):
        return out
    if prog in ("python", "python3", "pip", "torchrun", "pytest", "ruff", "torchft_lighthouse"):
        if words[:3] != ["python3", "-m", "venv"]:
            return [f"{prog!r}: call it as .venv/bin/{prog}, as every other command does"]
        return out
    if not prog.startswith(".venv/bin/"):
        return [f"unknown program {prog!r}"]
    name = prog.removeprefix(".venv/bin/")
    if not (VENV_BIN / name).exists():
        out.append(f"{prog}: not in the virtual environment")
    args = words[1:]
    script: Path | None = None
    module = ""
    if name in ("python", "python3"):
        if args[:1] == ["-m"]:
            module, args = args[1], args[2:]
            file = ROOT / (module.replace(".", "/") + ".py")
            if module.split(".")[0] not in EXTERNAL_MODULES:
                if not file.is_file():
                    out.append(f"-m {module}: no {file.relative_to(ROOT)}")
                script = file
        elif args and not args[0].startswith("-"):
            script, args = ROOT / args[0], args[1:]
            if not script.is_file():
                out.append(f"{words[1]}: no such file")
    elif name in EXTERNAL_FLAGS:
        known = EXTERNAL_FLAGS[name]
        rest = list(args)
        while rest and rest[0].startswith("--"):
            flag = rest.pop(0).partition("=")[0]
            if flag not in known:
                out.append(f"{name} {flag}: not a flag the docs know it takes")
            if rest and not rest[0].startswith("--") and flag != "--standalone":
                rest.pop(0)
        if name == "torchrun" and rest:
            script, args = ROOT / rest[0], rest[1:]
            if not script.is_file():
                out.append(f"{rest[0]}: no such file")
    for word in args:
        path = _repo_path(word)
        if path is not None and not path.exists():
            out.append(f"{word}: no such file or folder")
    if script is None or not script.is_file():
        return out
    source = script.read_text(encoding="utf-8")
    takes_config = "load_job_config" in source or script.name == "train.py"
    for word in args:
        if not word.startswith("--"):
            continue
        flag = word.partition("=")[0]
        if "." in flag and takes_config:
            if error := check_config_flag(flag):
                out.append(error)
        elif flag == "--nproc_per_node" and script.name == "train.py":
            pass
        elif f'"{flag}"' not in source:
            out.append(f"{script.relative_to(ROOT)} takes no {flag}")
    if takes_config and not out and script.parent in (ROOT, ROOT / "scripts", ROOT / "examples"):
        out += _load(args, expect_error=cmd.then == "||")
    return out


def _load(args: list[str], expect_error: bool) -> list[str]:
    """Load the config arguments of a command as train.py does (from the repository root)."""
    from config import ConfigError, load_job_config

    config_args, rest = [], list(args)
    while rest:
        word = rest.pop(0)
        if word.startswith("--") and "." in word:
            config_args.append(word)
            if "=" not in word and rest and not rest[0].startswith("--"):
                config_args.append(rest.pop(0))
    here = Path.cwd()
    os.chdir(ROOT)
    try:
        load_job_config(config_args)
    except ConfigError as e:
        return [] if expect_error else [f"config refused: {e}"]
    finally:
        os.chdir(here)
    return ["a command followed by || should fail to load its config"] if expect_error else []


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=str)
def test_every_command_names_what_exists_and_calls_python_one_way(block: Block):
    found = [f"{p}  [{' '.join(c.words)[:80]}]" for c in commands(block.body) for p in problems(c)]
    assert not found, f"{block}:\n" + "\n".join(found)


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=str)
def test_each_run_has_its_own_dump_folder_and_nothing_is_left_in_the_background(block: Block):
    cmds = commands(block.body)
    if any(c.then == "&" for c in cmds):
        assert any(c.words[0] == "kill" for c in cmds), f"{block}: starts a process it never ends"
    assert not any(c.words == ["wait"] for c in cmds), f"{block}: a bare wait waits for all"
    for c in cmds:
        if "train.py" in c.words and not _is_setup(c):
            assert "--job.dump_folder" in c.words, (
                f"{block}: a train.py run without --job.dump_folder outputs/<its own>"
            )


def _is_setup(c: Command) -> bool:
    """The set-up command trains the debug job in its TOML's own folder (outputs/debug)."""
    return c.words[-4:] == ["--nproc_per_node", "2", "--job.config_file", "config/debug.toml"]


def test_no_two_blocks_share_a_dump_folder():
    owner: dict[str, str] = {}
    for block in SHELL_BLOCKS:
        folders = {
            c.words[i + 1]
            for c in commands(block.body)
            for i, w in enumerate(c.words[:-1])
            if w == "--job.dump_folder"
        }
        for folder in folders:
            assert folder not in owner, f"{block} and {owner[folder]} both write {folder}"
            owner[folder] = str(block)


def test_the_readme_test_command_is_ci_run():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    lines = [line for b in blocks(README) if b.lang in SHELLS for line in b.body.splitlines()]
    assert ci in lines


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "toml"], ids=str)
def test_every_toml_block_names_existing_sections_and_keys(block: Block):
    from config import ParamGroup

    doc = tomllib.loads(block.body)
    sections = _sections()
    for section, table in doc.items():
        assert section in sections, f"{block}: no section [{section}]"
        for key, value in table.items():
            if (section, key) == ("optimizer", "param_groups"):
                for group in value:
                    assert set(group) <= _fields(ParamGroup), f"{block}: {set(group)}"
            else:
                assert key in _fields(sections[section]), f"{block}: [{section}] {key}"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=str)
def test_every_python_block_compiles_and_a_file_block_is_its_file(block: Block):
    compile(block.body, str(block), "exec")
    if block.mark.startswith("file:"):
        path = ROOT / block.mark.removeprefix("file:").strip()
        assert block.body == path.read_text(encoding="utf-8"), f"{block}: differs from {path}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_and_links_in_the_text_exist(path: Path):
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    missing = []
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in link and not (path.parent / link).exists():
            missing.append(link)
    for span in re.findall(r"`([^`\s]+)`", text):
        word = span.rstrip(".,:")
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)+/?", word):
            continue
        if (target := _repo_path(word)) is not None and not target.exists():
            missing.append(word)
    assert not missing, f"{path.name}: {missing}"


def test_readme_and_benchmarks_readme_stay_short():
    for path in (README, ROOT / "benchmarks" / "README.md"):
        assert len(path.read_text().splitlines()) <= 300, path


def _docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = [tree, *ast.walk(tree)]
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        (getattr(n, "lineno", 1), doc)
        for n in nodes
        if isinstance(n, kinds) and (doc := ast.get_docstring(n, clean=False))
    ]


def test_no_development_history_in_user_text_or_library_docstrings():
    texts = [(str(p.relative_to(ROOT)), 1, p.read_text(encoding="utf-8")) for p in USER_TEXT]
    for path in sorted((ROOT / "containers").rglob("*.py")):
        texts += [(str(path.relative_to(ROOT)), n, doc) for n, doc in _docstrings(path)]
    found = []
    for where, first, text in texts:
        for i, line in enumerate(text.splitlines()):
            for pattern in HISTORY:
                if match := pattern.search(line):
                    found.append(f"{where}:{first + i}: {match[0]!r} in {line.strip()[:80]}")
    assert not found, "\n".join(found)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout as symlinks, with its own `outputs/` and `.venv` (this interpreter's)."""
    where = tmp_path_factory.mktemp("checkout")
    skip = {".git", ".venv", "outputs", ".pytest_cache", ".ruff_cache", "__pycache__"}
    for entry in ROOT.iterdir():
        if entry.name not in skip:
            (where / entry.name).symlink_to(entry)
    (where / ".venv").symlink_to(VENV_BIN.parent)
    return where


CI_PYTHON = [b for b in ALL if b.lang == "python" and b.mark == "ci"]
CI_SHELL = [b for b in SHELL_BLOCKS if b.mark == "ci"]
RUNNER = """
import runpy, sys, traceback
sys.path.insert(0, ".")
failed = 0
for name in sys.argv[1:]:
    try:
        runpy.run_path(name, run_name="__main__")
    except BaseException:
        failed += 1
        print(f"FAILED: {name}", file=sys.stderr)
        traceback.print_exc()
sys.exit(failed)
"""


@pytest.mark.slow
def test_the_python_blocks_marked_ci_run(checkout: Path):
    names = []
    for i, block in enumerate(CI_PYTHON):
        name = checkout / f"block_{i}_{block.path.stem}_{block.line}.py"
        name.write_text(block.body)
        names.append(name.name)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *names],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.parametrize("block", CI_SHELL, ids=str)
@pytest.mark.slow
def test_the_commands_marked_ci_run_as_written(block: Block, checkout: Path):
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.body],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{block}\n" + done.stdout[-3000:] + done.stderr[-6000:]
