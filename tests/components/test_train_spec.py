"""TrainSpec registry, its typed builders, and the built-in "llama" spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from components import train_spec
from components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers
from components.optimizer import build_optimizers
from components.train_spec import Dataloader, TrainSpec, get_train_spec, register_train_spec
from config import ConfigError, LRScheduler, Model, Optimizer, Training
from tests.harness.dist import REPO


def _spec(name: str) -> TrainSpec:
    return TrainSpec(
        name=name,
        build_model_fn=lambda cfg: torch.nn.Linear(2, 2),
        parallelize_fn=lambda model, cfg, mesh, stages, **_: [model],
        build_loss_fn=lambda cfg: F.mse_loss,
        build_dataloader_fn=lambda cfg, rank, world: iter(()),
    )


@pytest.fixture
def restore():
    for name in train_spec.BUILTINS:  # the built-ins are in the snapshot: restoring keeps them
        get_train_spec(name)
    saved = dict(train_spec._SPECS)
    yield
    train_spec._SPECS.clear()
    train_spec._SPECS.update(saved)


def test_register_and_get(restore):
    spec = _spec("toy")
    register_train_spec(spec)
    assert get_train_spec("toy") is spec
    assert spec.build_optimizers_fn is build_optimizers
    assert spec.build_lr_schedulers_fn is build_lr_schedulers


def test_duplicates_refused_and_unknown_lists_known(restore):
    register_train_spec(_spec("toy"))
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register_train_spec(_spec("toy"))
    with pytest.raises(ValueError, match="'llama' is already registered"):
        register_train_spec(_spec("llama"))
    with pytest.raises(
        ConfigError, match=r"'nope': unknown train spec; registered: llama, moe, toy"
    ):
        get_train_spec("nope")
    with pytest.raises(ValueError, match="expected a TrainSpec"):
        register_train_spec("toy")  # type: ignore[arg-type]


@pytest.mark.slow
def test_generic_modules_never_import_a_model_family():
    """`import components` and its generic modules leave `components.models` unimported;
    the first `get_train_spec` registers the built-ins."""
    code = (
        "import sys, components, components.checkpoint, components.job, "
        "components.lr_scheduler, components.metrics, components.optimizer, "
        "components.parallelize, components.train_spec as ts\n"
        "before = sorted(m for m in sys.modules if m.startswith('components.models'))\n"
        "print(before, ts.get_train_spec('llama').name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "llama"]


def test_llama_builders_take_their_own_sections():
    """Model from [model] (seeded by the caller), parts, loss and data from [training]."""
    spec = get_train_spec("llama")
    model_cfg, training = (
        Model(flavor="tiny", num_parts=2),
        Training(seq_len=16, local_batch_size=3),
    )

    torch.manual_seed(5)
    a = spec.build_model_fn(model_cfg)
    torch.manual_seed(5)
    b = spec.build_model_fn(model_cfg)
    c = spec.build_model_fn(model_cfg)  # the builder does not reseed: another init
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(b.parameters()), next(c.parameters()))
    with pytest.raises(ConfigError, match=r"\[model\] flavor = 'huge': unknown flavor"):
        spec.build_model_fn(Model(flavor="huge"))

    parts = spec.parallelize_fn(a, model_cfg, None, range(model_cfg.num_parts))
    assert len(parts) == 2

    data = spec.build_dataloader_fn(training, 1, 2)
    assert isinstance(data, Dataloader)
    inputs, labels = next(data)
    assert inputs.shape == labels.shape == (3, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    position = data.state_dict()
    again = spec.build_dataloader_fn(training, 1, 2)
    again.load_state_dict(position)
    assert torch.equal(next(again)[0], next(data)[0])

    logits = torch.randn(3, 16, 256, generator=torch.Generator().manual_seed(0))
    loss = spec.build_loss_fn(training)(logits, labels)
    expected = F.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)

    optimizers = spec.build_optimizers_fn(parts, Optimizer(lr=1e-2))
    schedulers = spec.build_lr_schedulers_fn(optimizers, LRScheduler(warmup_steps=1), 4)
    assert isinstance(schedulers, LRSchedulersContainer) and len(schedulers) == 2
    assert schedulers.get_last_lr() == pytest.approx(1e-2 / 2)


@pytest.mark.slow
def test_the_built_in_family_registers_from_a_checkout_without_package_metadata(tmp_path):
    """A source checkout on PYTHONPATH, not installed: the base interpreter (normal site
    set-up, no -S) sees this venv's packages but not this project's distribution, whose
    metadata (and its entry points) it then cannot find; `llama` still registers."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs a virtual environment: its base interpreter lacks the install")
    (site,) = {p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages")}
    for entry in Path(site).iterdir():  # the venv's packages, without this project's install
        if not entry.name.startswith(("optimizer_containers", "__editable__")):
            (tmp_path / entry.name).symlink_to(entry)
    for package in ("components", "config", "containers"):
        (tmp_path / package).symlink_to(Path(REPO) / package)
    code = (
        "import importlib.metadata as md\n"
        "try:\n"
        "    md.distribution('optimizer-containers')\n"
        "    raise SystemExit('the package metadata is visible: this proves nothing')\n"
        "except md.PackageNotFoundError:\n"
        "    pass\n"
        "from components.train_spec import get_train_spec\n"
        "print(get_train_spec('llama').name)\n"
    )
    out = subprocess.run(
        [sys._base_executable, "-c", code],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.split() == ["llama"], out.stderr[-3000:]


@pytest.mark.slow
def test_quickstart_help_prints_usage():
    out = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and not out.stderr, out.stderr[-3000:]
    assert "Quick start" in out.stdout and "--job.config_file" in out.stdout
    assert "[optimizer]" in out.stdout  # the config keys it takes
