"""TrainSpec registry."""

from __future__ import annotations

import pytest

from components import train_spec
from components.optimizer import build_optimizers
from components.train_spec import TrainSpec, get_train_spec, register_train_spec
from config import ConfigError


def _spec(name: str) -> TrainSpec:
    return TrainSpec(
        name=name,
        build_model_fn=lambda cfg: None,
        parallelize_fn=lambda model, cfg, mesh: [model],
        build_loss_fn=lambda cfg: None,
        build_dataloader_fn=lambda cfg, rank, world: iter(()),
    )


@pytest.fixture
def restore():
    saved = dict(train_spec._SPECS)
    yield
    train_spec._SPECS.clear()
    train_spec._SPECS.update(saved)


def test_register_and_get(restore):
    spec = _spec("toy")
    register_train_spec(spec)
    assert get_train_spec("toy") is spec
    assert spec.build_optimizers_fn is build_optimizers
    assert spec.build_lr_schedulers_fn is None


def test_duplicates_refused_and_unknown_lists_known(restore):
    register_train_spec(_spec("toy"))
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register_train_spec(_spec("toy"))
    with pytest.raises(ConfigError, match=r"name = 'nope': unknown train spec; registered: .*toy"):
        get_train_spec("nope")
    with pytest.raises(ValueError, match="expected a TrainSpec"):
        register_train_spec("toy")  # type: ignore[arg-type]
