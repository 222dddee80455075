"""Ways in and a way back: a torchtitan-layout folder seeds train.py ([checkpoint]
initial_load_path); `python -m scripts.convert` turns ours into torchtitan's and back, and a
plain `torch.save` file into ours.

Sources are written here as their owners write them: torchtitan's layout through torch's DCP
API (top-level weights with `_orig_mod.`, torch's flat optimizer format, `last_epoch`,
`step` + `ntokens_seen`, per-rank pickled data loader state), the plain file by `torch.save`
of a model's and a torch optimizer's own `state_dict()`. The runs that load them are
train.py's `main` on real gloo ranks (`train_resumed`: state gathered at the first optimizer
step, before any update).
"""

from __future__ import annotations

import logging
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from components.checkpoint.seed import open_seed
from components.job import validate_job
from components.train_spec import get_train_spec
from config import ConfigError, load_job_config
from containers.update.forms import MOMENT_CODECS
from scripts.convert import _read_all
from scripts.convert import main as convert
from tests.harness.dist import run_ranks
from tests.harness.helpers import load_job_state, train_resumed
from tests.test_train import BASE

ARGS = [*BASE, "--training.steps", "3", "--checkpoint.enable"]
SOURCE_STEP = 2


def _trained(optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW) -> tuple:
    """BASE's model and a torch optimizer over it, after SOURCE_STEP steps on random tokens."""
    cfg = load_job_config(BASE)
    torch.manual_seed(7)
    model = get_train_spec(cfg.model.name).build_model_fn(cfg.model)
    opt = optimizer_cls(model.parameters(), lr=1e-2)
    for _ in range(SOURCE_STEP):
        tokens = torch.randint(0, 256, (2, 32))
        model(tokens).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _compiled(fqn: str) -> str:
    """The FQN as a model whose blocks are `torch.compile`d names it."""
    return re.sub(r"^(layers\.\d+)\.", r"\1._orig_mod.", fqn)


def _write_torchtitan(path: Path) -> tuple[dict, dict]:
    """A torchtitan-layout checkpoint at SOURCE_STEP; return its weights and optimizer state
    (plain FQNs, torch's flat format)."""
    model, opt = _trained()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    optim = get_optimizer_state_dict(model, opt, options=options)
    kind = re.compile(r"^(state|param_groups)\.(.+)\.([^.]+)$")
    state = {_compiled(k): v for k, v in weights.items()}
    state["optimizer"] = {
        kind.sub(lambda m: f"{m[1]}.{_compiled(m[2])}.{m[3]}", k): v for k, v in optim.items()
    }
    state["lr_scheduler"] = {"last_epoch": SOURCE_STEP}
    state["train_state"] = {"step": SOURCE_STEP, "ntokens_seen": SOURCE_STEP * 64}
    state["dataloader"] = {"dp_rank_0": pickle.dumps({"sample_idx": 4}), "world_size": 1}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return weights, optim


@dataclass
class Seeded:
    weights: dict[str, torch.Tensor]
    optim: dict[str, Any]
    source: Path
    dump: Path
    ranks: list[dict[str, Any]]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    """A torchtitan folder (1 process) seeding a 2-rank run with optimizer state and step."""
    root = tmp_path_factory.mktemp("migrating")
    source, dump = root / "torchtitan", root / "seeded"
    weights, optim = _write_torchtitan(source)
    argv = [*ARGS, "--job.dump_folder", str(dump), "--checkpoint.initial_load_path", str(source)]
    argv += ["--checkpoint.initial_load_model_only", "false"]
    ranks = run_ranks(2, train_resumed, argv, timeout=240)
    assert [r["code"] for r in ranks] == [0, 0]
    return Seeded(weights, optim, source, dump, ranks)


def test_a_torchtitan_folder_seeds_model_optimizer_and_step(seeded):
    # What both ranks would say (the keys nothing here takes) is said once, in train.log.
    assert (seeded.dump / "train.log").read_text().count("not used, nothing here takes") == 1
    for got in seeded.ranks:  # resharded: saved by 1 process, FSDP2 over 2 ranks here
        assert got["step"] == SOURCE_STEP and got["sched"] == SOURCE_STEP
        assert got["model"].keys() == seeded.weights.keys()
        assert all(torch.equal(got["model"][k], v) for k, v in seeded.weights.items())
        state = {k: v for k, v in seeded.optim.items() if k.startswith("state.")}
        assert state and all(torch.equal(got["optim"][k], v) for k, v in state.items())
        assert got["optim"]["state.output.weight.step"].item() == SOURCE_STEP


def test_convert_ours_to_torchtitan_and_back_keeps_every_value(seeded, tmp_path):
    ours = seeded.dump / "checkpoint" / "step-3"  # written by train.py at 2 ranks
    titan, back = tmp_path / "titan", tmp_path / "back" / "checkpoint" / "step-3"
    assert convert([str(ours), str(titan)]) == 0
    t = _read_all(titan)
    assert "tok_embeddings.weight" in t and not any(k.startswith("model.") for k in t)
    assert t["lr_scheduler.last_epoch"] == 3 and "lr_scheduler.step" not in t
    assert (
        t["train_state.step"] == 3
        and t["train_state.ntokens_seen"] == t["dataloader.sample_index"] * 32
    )
    assert convert([str(titan), str(back), *ARGS]) == 0
    a, b = _read_all(ours), _read_all(back)
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def test_a_torch_save_file_converted_resumes_at_two_ranks(tmp_path):
    model, opt = _trained(torch.optim.Adam)
    src, dump = tmp_path / "model.pt", tmp_path / "run"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    dst = dump / "checkpoint" / f"step-{SOURCE_STEP}"
    assert convert([str(src), str(dst), "--step", str(SOURCE_STEP), *BASE]) == 0
    ranks = run_ranks(2, train_resumed, [*ARGS, "--job.dump_folder", str(dump)], timeout=240)
    fqn = {p: n for n, p in model.named_parameters()}
    for got in ranks:
        assert got["code"] == 0 and got["step"] == SOURCE_STEP and got["sched"] == SOURCE_STEP
        assert all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items())
        for p, state in opt.state.items():
            for name, value in state.items():
                assert torch.equal(got["optim"][f"state.{fqn[p]}.{name}"], value), (fqn[p], name)


def test_seed_and_convert_refuse_what_they_cannot_use(seeded, tmp_path, caplog):
    off = ["--checkpoint.enable", "false", "--checkpoint.initial_load_path", str(seeded.source)]
    with pytest.raises(
        ConfigError, match=r"initial_load_path = .*: only \[checkpoint\] enable = true reads it"
    ):
        load_job_config([*BASE, *off])
    # Checked before any rank starts, when it would be used: a run that has its own
    # checkpoint restarts with the same arguments even once the seed is gone.
    gone = [*ARGS, "--checkpoint.initial_load_path", "/no/such", "--job.dump_folder"]
    with pytest.raises(ConfigError, match=r"initial_load_path = '/no/such': no such folder"):
        validate_job(load_job_config([*gone, str(tmp_path / "new")]))
    validate_job(load_job_config([*gone, str(seeded.dump)]))
    with pytest.raises(
        ConfigError, match=r"a folder of checkpoints, not one; point at one of them, e.g. .*step-3"
    ):
        open_seed(str(seeded.dump / "checkpoint"), model_only=True)
    other = tmp_path / "other"
    dcp.save({"train_state": {"step": 1}}, checkpoint_id=other, no_dist=True)
    with pytest.raises(ConfigError, match=r"holds neither our layout .* nor torchtitan's"):
        open_seed(str(other), model_only=True)
    weights_only = tmp_path / "weights"
    dcp.save(dict(seeded.weights), checkpoint_id=weights_only, no_dist=True)
    with pytest.raises(
        ConfigError, match=r"holds model weights only .* initial_load_model_only = true"
    ):
        open_seed(str(weights_only), model_only=False)
    with pytest.raises(
        ConfigError,
        match=r"does not match this job .*shape mismatches \[layers.0._orig_mod.attention",
    ):
        convert([str(seeded.source), str(tmp_path / "x"), *BASE, "--model.flavor", "debug"])
    with pytest.raises(ConfigError, match=r"DST = .* exists"):
        convert([str(seeded.source), str(other)])
    plain = tmp_path / "plain.pt"
    torch.save({"weights": {}}, plain)
    with pytest.raises(ConfigError, match=r"expected a dict with 'model' .* and 'optimizer'"):
        convert([str(plain), str(tmp_path / "y"), *BASE])
    # torchtitan's per-rank data loader blobs are named and skipped in one line.
    with caplog.at_level(logging.INFO):
        assert convert([str(seeded.source), str(tmp_path / "z" / "step-2"), *ARGS]) == 0
    skipped = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(skipped) == 1 and "dataloader.dp_rank_0" in skipped[0]
    assert "train_state.ntokens_seen" in skipped[0] and "first sample" in skipped[0]


def test_weights_only_by_default_and_the_runs_own_checkpoint_wins(seeded, tmp_path):
    argv = [*ARGS, "--checkpoint.initial_load_path", str(seeded.source)]
    mixed = [*argv, "--optimizer.container", "mixed_precision"]
    runs = [
        (str(tmp_path / "fresh"), argv),
        (str(tmp_path / "mp"), mixed),
        (str(seeded.dump), argv),
    ]
    fresh, mp, own = run_ranks(1, _load_each, runs)[0]
    assert fresh["step"] == 0 and fresh["sched"] == 0
    assert all(torch.equal(fresh["model"][k], v) for k, v in seeded.weights.items())
    assert all(not v.any() for k, v in fresh["optim"].items() if k.startswith("state."))
    # bf16 weights with fp32 masters: the masters are the saved weights, not their bf16 cast.
    for k, v in seeded.weights.items():
        assert torch.equal(mp["optim"][f"master_weights.{k}"], v)
        assert torch.equal(mp["model"][k], v.bfloat16())
    assert own["step"] == 3  # its own step-3, not the seed's step 2


def _load_each(runs: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
    return [load_job_state(dump, argv) for dump, argv in runs]


def test_a_seed_of_fp32_moments_into_8bit_moments_is_converted_and_said_once(seeded, tmp_path):
    """fp32 moments seed an 8-bit run: matrices' moments coded, vectors' rounded to bf16
    (what an 8-bit group keeps of them), both said in one line."""
    dump = tmp_path / "lean"
    argv = [*ARGS, "--job.dump_folder", str(dump), "--checkpoint.initial_load_path"]
    argv += [str(seeded.source), "--checkpoint.initial_load_model_only", "false"]
    ranks = run_ranks(2, train_resumed, [*argv, "--optimizer.moment_dtype", "8bit"], timeout=240)
    assert [r["code"] for r in ranks] == [0, 0]
    log = (dump / "train.log").read_text()
    said = "converted on load: exp_avg, exp_avg_sq float32 -> bfloat16 ("
    assert log.count(said) == 1, log
    assert "; exp_avg, exp_avg_sq tensor -> 8-bit codes (" in log.split(said)[1].split("\n")[0]
    moments = {k: v for k, v in seeded.optim.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert {v.dim() >= 2 for v in moments.values()} == {True, False}  # matrices and vectors
    for got in ranks:
        for key, value in moments.items():
            if value.dim() < 2:
                assert got["optim"][key].dtype == torch.bfloat16
                assert torch.equal(got["optim"][key], value.bfloat16()), key
                continue
            name = key.rsplit(".", 1)[1]
            want = MOMENT_CODECS["8bit"].from_values(name, value, value)
            assert torch.equal(got["optim"][f"{key}.code"], want["code"]), key
            assert torch.equal(got["optim"][f"{key}.scale"], want["scale"]), key
