"""The floors of the code base: imports only go down, and no generic module imports a model
family (see ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.dist import REPO

# Lower floors first; a module may import its own floor and those below it. The library,
# `containers`, is lowest: it stands alone (a project with its own `config` imports it).
FLOORS = ["containers", "config", "components", "components.models"]


def _floor(module: str) -> int:
    return max(i for i, f in enumerate(FLOORS) if module == f or module.startswith(f + "."))


def _ours(module: str) -> bool:
    return module.split(".")[0] in ("config", "containers", "components")


def _all_imports(path: Path) -> list[str]:
    """The absolute module names `path` imports, anywhere in it (top level or in a function)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def _imports(path: Path) -> list[str]:
    return [m for m in _all_imports(path) if _ours(m)]


MODULES = sorted(
    p for pkg in ("config", "containers", "components") for p in (Path(REPO) / pkg).rglob("*.py")
)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_only_go_down(path):
    module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    up = [m for m in _imports(path) if _floor(m) > _floor(module)]
    assert not up, f"{module} imports {up} from a floor above its own"


def test_the_floors_are_checked_at_all():
    assert len(MODULES) > 20
    assert _floor("components.models.llama.model") > _floor("components.job")
    assert _floor("containers.container") < _floor("config.loader")


@pytest.mark.slow
def test_containers_imports_without_the_trainers_packages():
    """A project with its own `config` (or `components`) package imports the library."""
    code = "import sys; sys.modules['config'] = sys.modules['components'] = None; import containers"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]


NATIVE_SUFFIXES = (".c", ".cpp", ".cu")


def test_containers_has_no_native_sources():
    """The library is Python over torch: no source to compile, no library loaded by hand."""
    root = Path(REPO) / "containers"
    native = sorted(
        str(p.relative_to(REPO)) for p in root.rglob("*") if p.suffix in NATIVE_SUFFIXES
    )
    ctypes_users = sorted(
        str(path.relative_to(REPO))
        for path in root.rglob("*.py")
        if any(m.split(".")[0] == "ctypes" for m in _all_imports(path))
    )
    assert not native and not ctypes_users, f"native sources {native}; ctypes users {ctypes_users}"


PART_KINDS = ("precision", "gate", "timing", "outer")


def _containers_modules() -> dict[str, list[str]]:
    """containers' modules (dotted) -> the containers modules each imports."""
    root = Path(REPO) / "containers"
    out = {}
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[module] = [m for m in _imports(path) if m.startswith("containers")]
    return out


def test_part_kinds_do_not_import_each_other_and_the_floor_imports_no_part():
    modules = _containers_modules()
    assert len(modules) > 15
    for module, imported in modules.items():
        kind = module.split(".")[1] if module.count(".") else None
        for m in imported:
            other = m.split(".")[1] if m.count(".") else None
            if kind in PART_KINDS:
                assert other not in PART_KINDS or other == kind, f"{module} imports {m}"
            if kind in ("state", "optim") or module in ("containers.parts", "containers.norm"):
                assert other not in PART_KINDS, f"{module} imports {m}"


def test_the_distribution_lists_every_package_of_the_library():
    """A package missing from pyproject.toml's list is missing from a non-editable install."""
    from scripts.plot import tomllib  # (tomli before Python 3.11)

    repo = Path(REPO)
    listed = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = {
        ".".join(init.parent.relative_to(repo).parts)
        for init in (repo / "containers").rglob("__init__.py")
    }
    assert sorted(listed) == sorted(found)


def test_the_library_imports_only_what_its_install_brings():
    """`pip install` of the library brings torch, torchft, numpy (pyproject's dependencies)
    and no trainer extra (tensorboard, matplotlib, xxhash): every module containers/ imports
    is the standard library's, its own or one of those. (`containers/torchtitan.py` imports
    torchtitan for torchtitan's users, who have it.)"""
    import ast
    import re
    import sys

    from scripts.plot import tomllib

    project = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]
    brought = {re.match(r"[\w-]+", d)[0].replace("-", "_") for d in project["dependencies"]}
    assert brought == {"torch", "torchft", "numpy"}, brought
    extra = {re.match(r"[\w-]+", d)[0] for d in project["optional-dependencies"]["trainer"]}
    assert {"tensorboard", "matplotlib", "xxhash"} <= extra
    imported: dict[str, str] = {}
    for path in (Path(REPO) / "containers").rglob("*.py"):
        if path.name == "torchtitan.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for name in names:
                imported.setdefault(name.split(".")[0], str(path))
    foreign = {
        top: where
        for top, where in imported.items()
        if top not in sys.stdlib_module_names and top not in brought | {"containers"}
    }
    assert not foreign, foreign


def _files_in_step(build: Callable[[], tuple[list[torch.Tensor], Any]]) -> set[str]:
    """The files under containers/ whose code runs inside one `step()` (a profile hook on
    every call), after two steps made the state."""
    params, opt = build()
    root = Path(REPO) / "containers"
    seen: set[str] = set()

    def hook(frame: Any, event: str, arg: Any) -> None:
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.is_relative_to(root):
            seen.add(str(path.relative_to(root)))

    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        if step == 2:
            sys.setprofile(hook)
        try:
            opt.step()
        finally:
            sys.setprofile(None)
    return seen


def test_an_8bit_step_runs_in_at_most_8_files_and_one_under_mixed_precision_in_10():
    """One pipeline, one driver: the step of a container with 8-bit moments crosses at most 8
    modules of the library (16 before the update engine), under mixed precision with
    remainders at most 10 (18)."""
    from containers import (
        LeanAdamW,
        MixedPrecisionOptimizersContainer,
        MixedPrecisionSettings,
        OptimizersContainer,
    )

    kwargs = {"lr": 1e-3, "fused": True, "moment_dtype": "8bit"}

    def plain() -> tuple[list[torch.Tensor], Any]:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        return list(model.parameters()), OptimizersContainer([model], LeanAdamW, kwargs)

    def mixed() -> tuple[list[torch.Tensor], Any]:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).bfloat16()
        settings = MixedPrecisionSettings(loss_scaling="none", store_param_remainders=True)
        opt = MixedPrecisionOptimizersContainer([model], LeanAdamW, kwargs, settings=settings)
        return list(model.parameters()), opt

    files = _files_in_step(plain)
    assert "update/codes8.py" in files and len(files) <= 8, sorted(files)
    files = _files_in_step(mixed)
    assert "update/codes8.py" in files and len(files) <= 10, sorted(files)
