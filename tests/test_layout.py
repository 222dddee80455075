"""The floors of the code base: imports only go down, and no generic module imports a model
family (see ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.harness.dist import REPO

# Lower floors first; a module may import its own floor and those below it.
FLOORS = ["config", "containers", "components", "components.models"]


def _floor(module: str) -> int:
    return max(i for i, f in enumerate(FLOORS) if module == f or module.startswith(f + "."))


def _ours(module: str) -> bool:
    return module.split(".")[0] in ("config", "containers", "components")


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return [m for m in found if _ours(m)]


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
    assert _floor("containers.container") > _floor("config.loader")


PART_KINDS = ("precision", "gate", "timing")


def _containers_modules() -> dict[str, list[str]]:
    """containers' modules (dotted) -> the containers modules each imports."""
    root = Path(REPO) / "containers"
    out = {}
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[module] = [m for m in _imports(path) if m.startswith("containers")]
    return out


def test_containers_top_level_is_small_and_each_subpackage_one_part_kind():
    root = Path(REPO) / "containers"
    top = sorted(p.name for p in root.glob("*.py"))
    assert len(top) <= 8, f"containers/ has {len(top)} top-level modules: {top}"
    subpackages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert subpackages == sorted([*PART_KINDS, "state", "optim"])


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
