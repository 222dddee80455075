"""Optimizer and container registries and `build_optimizers`."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from components.models.llama.model import FLAVORS, Transformer, split_model
from components.optimizer import build_optimizers, register_container, register_optimizer, registry
from components.optimizer.settings import implementation_kwargs, slower_than_compiled
from config import ConfigError, ParamGroup, load_job_config
from config import Optimizer as OptimizerConfig
from containers import LeanAdamW, OptimizersContainer, ParamGroupRule, ShardedMuon
from tests.harness.dist import REPO, run_ranks
from tests.harness.helpers import assert_same, three_parts, train


@pytest.fixture
def restore_registries():
    saved = dict(registry.OPTIMIZERS), dict(registry.CONTAINERS)
    yield
    registry.OPTIMIZERS.clear()
    registry.OPTIMIZERS.update(saved[0])
    registry.CONTAINERS.clear()
    registry.CONTAINERS.update(saved[1])


def _inner(container: OptimizersContainer) -> list[dict]:
    return [g for g in container.param_groups]


@pytest.mark.parametrize(
    ("name", "cls"),
    [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam), ("SGD", torch.optim.SGD)],
)
def test_builtin_optimizers_build_from_config(name, cls):
    momentum = {"momentum": 0.5} if cls is torch.optim.SGD else {}  # (Adam's refuse it)
    cfg = OptimizerConfig(name=name, lr=3e-3, weight_decay=0.05, **momentum)
    container = build_optimizers(three_parts(), cfg)
    assert type(container) is OptimizersContainer
    assert all(type(o) is cls for o in container)
    group = container.param_groups[0]
    assert group["lr"] == 3e-3 and group["weight_decay"] == 0.05
    if cls is not torch.optim.SGD:
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-8
    else:
        assert group["momentum"] == 0.5


def test_auto_picks_fused_on_cpu_and_matches_torch_fused_bitwise():
    parts = three_parts()
    ref_parts = copy.deepcopy(parts)
    container = build_optimizers(parts, OptimizerConfig(lr=1e-2))
    assert all(g["fused"] is True for g in container.param_groups)
    ref = torch.optim.AdamW(
        [p for m in ref_parts for p in m.parameters()],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=True,
    )
    train(parts, container, 5)
    train(ref_parts, ref, 5)
    for a, b in zip(
        (p for m in parts for p in m.parameters()), (p for m in ref_parts for p in m.parameters())
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("impl", "flags"),
    [
        ("fused", {"fused": True}),
        ("foreach", {"foreach": True, "fused": False}),
        ("for-loop", {"foreach": False, "fused": False}),
    ],
)
def test_explicit_implementations(impl, flags):
    container = build_optimizers(three_parts(), OptimizerConfig(implementation=impl))
    for group in container.param_groups:
        for key, value in flags.items():
            assert group[key] is value


def test_impossible_implementation_is_a_clear_error():
    class NoFlags(torch.optim.SGD):
        def __init__(self, params, lr: float = 0.1) -> None:
            super().__init__(params, lr=lr)

    with pytest.raises(ConfigError, match=r"implementation = 'fused': NoFlags has no fused"):
        implementation_kwargs(NoFlags, "fused", torch.device("cpu"), "[optimizer]")
    with pytest.raises(ConfigError, match=r"implementation = 'foreach': NoFlags takes no"):
        implementation_kwargs(NoFlags, "foreach", torch.device("cpu"), "[optimizer]")
    with pytest.raises(ConfigError, match=r"Adamax has no fused kernel"):
        implementation_kwargs(torch.optim.Adamax, "fused", torch.device("cpu"), "[optimizer]")
    with pytest.raises(ConfigError, match=r"AdamW has none on meta"):
        implementation_kwargs(torch.optim.AdamW, "fused", torch.device("meta"), "[optimizer]")
    assert implementation_kwargs(NoFlags, "auto", torch.device("cpu"), "[optimizer]") == {}


def test_8bit_moments_stepped_eagerly_on_a_gpu_are_pointed_to_the_compiled_step():
    """One log line where a GPU job keeps 8-bit moments without `implementation =
    'compiled'` (its eager path several times slower, as measured); none on a CPU (one pass
    there) or where the step is compiled already. (Asks no device: 8-bit needs no probe.)"""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    coded = {"moment_dtype": "8bit", "fused": True}
    note = slower_than_compiled(LeanAdamW, coded, cuda)
    assert "moment_dtype = '8bit' on CUDA" in note and "implementation = 'compiled'" in note
    assert slower_than_compiled(LeanAdamW, coded, cpu) == ""
    assert slower_than_compiled(LeanAdamW, {**coded, "compiled": True}, cuda) == ""
    assert slower_than_compiled(LeanAdamW, {"fused": True}, cuda) == ""
    assert slower_than_compiled(torch.optim.AdamW, {"fused": True}, cuda) == ""


def test_register_optimizer_adds_one_and_refuses_duplicates(restore_registries):
    register_optimizer("ASGD", lambda cfg: (torch.optim.ASGD, {"lr": cfg.lr}))
    container = build_optimizers(three_parts(), OptimizerConfig(name="ASGD", lr=0.02))
    assert all(type(o) is torch.optim.ASGD for o in container)
    assert container.param_groups[0]["foreach"] is None  # auto: ASGD has no fused kernel
    with pytest.raises(ValueError, match="'ASGD' is already registered"):
        register_optimizer("ASGD", lambda cfg: (torch.optim.ASGD, {}))
    with pytest.raises(ValueError, match="'AdamW' is already registered"):
        register_optimizer("AdamW", lambda cfg: (torch.optim.AdamW, {}))
    with pytest.raises(ValueError, match="not callable"):
        register_optimizer("Broken", "not a factory")
    with pytest.raises(ValueError, match="optimizer name '': expected a non-empty string"):
        register_optimizer("", lambda cfg: (torch.optim.ASGD, {}))


def test_the_fault_tolerant_container_without_a_torchft_manager_is_one_config_error():
    with pytest.raises(ConfigError, match=r"needs a torchft manager; set \[fault_tolerance\]"):
        build_optimizers(three_parts(), OptimizerConfig(container="fault_tolerant"))


def test_parts_with_trainable_parameters_on_two_devices_are_refused_when_built():
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")]
    with pytest.raises(ValueError, match=r"trainable parameters span devices \['cpu', 'meta'\]"):
        build_optimizers(parts, OptimizerConfig())


def test_register_container_selects_by_name(restore_registries):
    class Counting(OptimizersContainer):
        steps = 0

        def step(self, closure=None):
            Counting.steps += 1
            return super().step(closure)

    def factory(parts, cls, kwargs, *, param_groups, marker, **composed):
        assert marker == 7
        parts_given = {"precision", "gate", "timing", "outer", "max_norm", "mesh", "ema"}
        assert composed.keys() == parts_given
        return Counting(parts, cls, kwargs, param_groups=param_groups, **composed)

    register_container("counting", factory)
    parts = three_parts()
    container = build_optimizers(parts, OptimizerConfig(container="counting"), marker=7)
    train(parts, container, 2)
    assert type(container) is Counting and Counting.steps == 2
    with pytest.raises(ValueError, match="'default' is already registered"):
        register_container("default", factory)


def test_unknown_names_list_the_registered_ones():
    registered = r"name = 'Lion': unknown optimizer; registered: Adafactor, Adagrad, Adam, "
    with pytest.raises(ConfigError, match=registered):
        build_optimizers(three_parts(), OptimizerConfig(name="Lion"))
    with pytest.raises(ConfigError, match=r"container = 'nope': unknown container; registered"):
        build_optimizers(three_parts(), OptimizerConfig(container="nope"))


def test_param_groups_from_toml(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        "[optimizer]\nname = 'AdamW'\nlr = 0.01\nweight_decay = 0.1\n"
        "[[optimizer.param_groups]]\npattern = '\\.bias$|norm'\nweight_decay = 0.0\n"
        "[[optimizer.param_groups]]\npattern = '^head\\.weight$'\nname = 'SGD'\nlr = 0.5\n"
    )
    cfg = load_job_config(["--job.config_file", str(toml)])
    container = build_optimizers(three_parts(), cfg.optimizer)
    assert [type(o).__name__ for o in container] == ["AdamW", "AdamW", "AdamW", "SGD"]
    sd = container.state_dict()
    assert sd["param_groups.head.bias.weight_decay"] == 0.0
    assert sd["param_groups.norm.weight.weight_decay"] == 0.0
    assert sd["param_groups.mid.weight.weight_decay"] == 0.1
    assert sd["param_groups.head.weight.lr"] == 0.5
    assert sd["param_groups.head.weight.weight_decay"] == 0.1
    # the head's bias matches both patterns
    bad = [ParamGroup(pattern="bias", weight_decay=0.0), ParamGroup(pattern="head")]
    with pytest.raises(ConfigError, match=r"\[optimizer\] parameter 'head.bias' matches"):
        build_optimizers(three_parts(), OptimizerConfig(param_groups=bad))
    none = [ParamGroup(pattern="^nothing$", lr=0.1)]
    with pytest.raises(ConfigError, match=r"\['\^nothing\$'\] match no trainable parameter"):
        build_optimizers(three_parts(), OptimizerConfig(param_groups=none))
    unknown = [ParamGroup(pattern="head", name="Lion")]
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\] name = 'Lion': unknown"):
        build_optimizers(three_parts(), OptimizerConfig(param_groups=unknown))


def _matrices(seed: int = 0) -> list[torch.nn.Module]:
    """Two parts of bias-free linears: only 2-D parameters (7 rows: uneven on 2 ranks)."""
    torch.manual_seed(seed)
    return [
        torch.nn.Sequential(OrderedDict(embed=torch.nn.Linear(10, 7, bias=False))),
        torch.nn.Sequential(OrderedDict(head=torch.nn.Linear(7, 5, bias=False))),
    ]


def _llama_parts() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return split_model(Transformer(FLAVORS["tiny"]), 2)


def _same_after_steps(parts, container, ref_parts, ref, steps: int = 3) -> None:
    train(parts, container, steps)
    train(ref_parts, ref, steps)
    for a, b in zip(
        (p for m in parts for p in m.parameters()), (p for m in ref_parts for p in m.parameters())
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("cfg", "cls", "expected"),
    [
        (
            OptimizerConfig(
                name="Muon", lr=0.02, weight_decay=0.01, ns_steps=3, ns_dtype="bfloat16"
            ),
            ShardedMuon,
            # momentum left unset: Muon's own 0.95 and nesterov, never a silent 0
            {"momentum": 0.95, "nesterov": True, "ns_steps": 3, "adjust_lr_fn": "original"},
        ),
        (
            OptimizerConfig(
                name="Muon",
                momentum=0.0,
                nesterov=False,
                adjust_lr_fn="match_rms_adamw",
                ns_dtype="bfloat16",
            ),
            ShardedMuon,
            {"momentum": 0.0, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
        ),
        (
            OptimizerConfig(name="Adafactor", beta2_decay=-0.5, d=2.0, eps1=1e-30, eps2=1e-2),
            torch.optim.Adafactor,
            {"beta2_decay": -0.5, "d": 2.0, "eps": (1e-30, 1e-2), "foreach": None},
        ),
        (
            OptimizerConfig(name="SGD", nesterov=True, momentum=0.5),
            torch.optim.SGD,
            {"momentum": 0.5, "nesterov": True},
        ),
        (OptimizerConfig(name="SGD"), torch.optim.SGD, {"momentum": 0.0, "nesterov": False}),
        (OptimizerConfig(name="NAdam"), torch.optim.NAdam, {"betas": (0.9, 0.95)}),
        (OptimizerConfig(name="RAdam"), torch.optim.RAdam, {"betas": (0.9, 0.95)}),
        (OptimizerConfig(name="Adamax"), torch.optim.Adamax, {"eps": 1e-8}),
        (OptimizerConfig(name="Adagrad"), torch.optim.Adagrad, {"fused": True}),
    ],
    ids=lambda v: getattr(v, "name", None) if isinstance(v, OptimizerConfig) else "",
)
def test_torch_optimizers_take_their_hyperparameters_from_config(cfg, cls, expected):
    parts = _matrices()
    ref_parts = copy.deepcopy(parts)
    container = build_optimizers(parts, cfg)
    assert all(type(o) is cls for o in container)
    group = container.param_groups[0]
    assert group["lr"] == cfg.lr and group["weight_decay"] == cfg.weight_decay
    assert {k: group[k] for k in expected} == expected
    settings = {k: v for k, v in group.items() if k not in ("params", "ns_dtype", "moment_dtype")}
    # ShardedMuon in one process, Newton-Schulz in bf16: torch's own Muon, bitwise.
    ref_cls = torch.optim.Muon if cls is ShardedMuon else cls
    ref = ref_cls([p for m in ref_parts for p in m.parameters()], **settings)
    _same_after_steps(parts, container, ref_parts, ref)


def test_muon_implementations():
    cpu = torch.device("cpu")
    for impl, dtensor in (("auto", False), ("auto", True), ("for-loop", True)):
        assert implementation_kwargs(torch.optim.Muon, impl, cpu, "[optimizer]", dtensor) == {}
    with pytest.raises(ConfigError, match=r"'fused': Muon has no fused kernel; use 'auto'$"):
        implementation_kwargs(torch.optim.Muon, "fused", cpu, "[optimizer]")
    with pytest.raises(ConfigError, match=r"'foreach': Muon takes no foreach flag; use 'auto'"):
        implementation_kwargs(torch.optim.Muon, "foreach", cpu, "[optimizer]")
    # Adafactor's torch default (foreach None) is its per-tensor loop, which DTensor runs.
    assert implementation_kwargs(torch.optim.Adafactor, "auto", cpu, "[optimizer]", True) == {}


def test_muon_toml_puts_muon_on_hidden_matrices_and_adamw_on_the_rest():
    cfg = load_job_config(["--job.config_file", str(Path(REPO) / "config" / "muon.toml")])
    parts = _llama_parts()
    container = build_optimizers(parts, cfg.optimizer)
    by_fqn = {
        fqn: (type(opt).__name__, group)
        for opt in container
        for group in opt.param_groups
        for fqn in (container._fqns[p] for p in group["params"])
    }
    muon = {fqn for fqn, (name, _) in by_fqn.items() if name == "ShardedMuon"}
    hidden = {
        f"layers.{i}.{block}.{w}.weight"
        for i in range(2)
        for block, names in (("attention", "wq wk wv wo"), ("feed_forward", "w1 w2 w3"))
        for w in names.split()
    }
    assert muon == hidden
    assert {"tok_embeddings.weight", "output.weight", "layers.0.attention_norm.weight"} <= (
        by_fqn.keys() - muon
    )
    assert {name for fqn, (name, _) in by_fqn.items() if fqn not in muon} == {"AdamW"}
    group = by_fqn["layers.1.feed_forward.w2.weight"][1]
    assert group["adjust_lr_fn"] == "match_rms_adamw" and group["momentum"] == 0.95
    assert group["lr"] == cfg.optimizer.param_groups[0].lr != cfg.optimizer.lr
    assert by_fqn["tok_embeddings.weight"][1]["weight_decay"] == 0.0
    assert by_fqn["output.weight"][1]["fused"] is True  # "auto" still picks fused AdamW


def test_muon_groups_inheriting_8bit_keep_bf16_momentum_and_say_it_once(caplog):
    """`[optimizer] moment_dtype = "8bit"` over muon.toml: AdamW's matrices keep codes, Muon's
    momentum (no codes) the leanest state it has, bf16; set on the Muon group itself, '8bit'
    is refused, and 'bfloat16' there is taken as given."""
    argv = ["--job.config_file", str(Path(REPO) / "config" / "muon.toml")]
    cfg = load_job_config([*argv, "--optimizer.moment_dtype", "8bit"]).optimizer
    with caplog.at_level("INFO", logger="components.optimizer"):
        container = build_optimizers(_llama_parts(), cfg)
    said = [
        r.getMessage() for r in caplog.records if "keeps its state in bfloat16" in r.getMessage()
    ]
    assert said == [
        "[optimizer.param_groups[0]] ShardedMuon keeps its state in bfloat16 ([optimizer] "
        "moment_dtype = '8bit': codes are Adam's and AdamW's moments)"
    ]
    kept = {(type(opt).__name__, g["moment_dtype"]) for opt in container for g in opt.param_groups}
    assert kept == {("ShardedMuon", "bfloat16"), ("LeanAdamW", "8bit")}
    muon = dataclasses.replace(cfg.param_groups[0], moment_dtype="8bit")
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\] moment_dtype = '8bit'.*Muon"):
        build_optimizers(_llama_parts(), dataclasses.replace(cfg, param_groups=[muon]))
    muon = dataclasses.replace(muon, moment_dtype="bfloat16")
    build_optimizers(_llama_parts(), dataclasses.replace(cfg, param_groups=[muon]))


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        # the default group is Muon: norms (1-D) fall into it
        (
            [],
            r"Muon of the default group \(no pattern\) got 'embed\.bias' \(7,\), 'mid\.bias' "
            r"\(9,\), 'norm\.weight' \(9,\), 'norm\.bias' \(9,\) and 1 more: it takes only 2-D",
        ),
        # a Muon group whose pattern also matches a norm
        (
            [ParamGroup(pattern=r"mid|norm", name="Muon")],
            r"Muon of param group 'mid\|norm' got 'mid\.bias' \(9,\), 'norm\.weight' \(9,\), "
            r"'norm\.bias' \(9,\): it takes only 2-D",
        ),
    ],
)
def test_muon_on_non_matrices_is_refused_before_anything_is_built(groups, message):
    parts = three_parts()
    before = [p.detach().clone() for m in parts for p in m.parameters()]
    cfg = OptimizerConfig(name="Muon" if not groups else "AdamW", param_groups=groups)
    with pytest.raises(ConfigError, match=message) as err:
        build_optimizers(parts, cfg)
    text = str(err.value)
    assert text.startswith("[optimizer] ")
    assert r"pattern 'layers\..*\.(attention|feed_forward)\..*weight'" in text
    assert "[optimizer] name = 'AdamW' plus [[optimizer.param_groups]]" in text
    for p, b in zip((p for m in parts for p in m.parameters()), before):
        assert torch.equal(p, b) and p.grad is None


def test_a_muon_subclass_is_refused_on_vectors_too():
    class DistributedMuon(torch.optim.Muon):
        pass

    rule = ParamGroupRule("norm", {}, DistributedMuon, {"lr": 0.02})
    with pytest.raises(ValueError, match=r"DistributedMuon of param group 'norm' got 'norm"):
        OptimizersContainer(three_parts(), torch.optim.AdamW, {"lr": 1e-2}, param_groups=[rule])


def test_muon_state_is_flat_and_round_trips_through_dcp(tmp_path):
    """Momentum buffers under `state.<fqn>.momentum_buffer`, next to AdamW's moments; a
    fresh container loads them and both then train on bitwise alike."""
    muon = ParamGroup(pattern="embed", name="Muon", lr=0.02, momentum=0.9)
    cfg = OptimizerConfig(name="AdamW", lr=1e-2, param_groups=[muon])
    parts = _matrices()
    container = build_optimizers(parts, cfg)
    fresh_sd = build_optimizers(_matrices(), cfg).state_dict()
    assert torch.equal(fresh_sd["state.embed.weight.momentum_buffer"], torch.zeros(7, 10))
    train(parts, container, 3)
    sd = container.state_dict()
    assert sd.keys() == fresh_sd.keys()
    assert {k for k in sd if k.startswith("state.")} == {
        "state.embed.weight.momentum_buffer",
        "state.head.weight.exp_avg",
        "state.head.weight.exp_avg_sq",
        "state.head.weight.step",
    }
    assert sd["param_groups.embed.weight.momentum"] == 0.9
    assert sd["param_groups.embed.weight.ns_steps"] == 5
    assert sd["state.embed.weight.momentum_buffer"].abs().sum() > 0
    dcp.save({"optim": container}, checkpoint_id=str(tmp_path), no_dist=True)

    loaded_parts = copy.deepcopy(parts)
    loaded = build_optimizers(loaded_parts, cfg)
    dcp.load({"optim": loaded}, checkpoint_id=str(tmp_path), no_dist=True)
    assert_same(loaded.state_dict(), sd)
    _same_after_steps(parts, container, loaded_parts, loaded)


def _adafactor_on_fsdp2() -> list[str]:
    parts = _matrices()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for part in parts:
        fully_shard(part, mesh=mesh)
    messages = []
    for cfg in (
        OptimizerConfig(name="Adafactor"),
        OptimizerConfig(param_groups=[ParamGroup(pattern="head", name="Adafactor")]),
    ):
        with pytest.raises(ConfigError) as err:
            build_optimizers(parts, cfg)
        messages.append(str(err.value))
    # torch's own Adafactor fails on these shards: the refusal is not stale
    with pytest.raises(RuntimeError, match="Sharding propagation failed"):
        train(parts, torch.optim.Adafactor([p for m in parts for p in m.parameters()]), 1)
    return messages


def test_adafactor_on_fsdp2_shards_is_refused_when_built():
    for default, group in run_ranks(2, _adafactor_on_fsdp2):
        assert default.startswith(
            "[optimizer] name = 'Adafactor': torch's Adafactor cannot step parameters sharded "
            "over ranks (FSDP2, tensor parallel): its factored second moment"
        )
        assert group.startswith("[optimizer.param_groups[0]] name = 'Adafactor': torch's")
        assert "train it on one rank or pick another optimizer" in group


def test_a_param_groups_key_its_optimizer_does_not_read_is_refused_and_one_it_reads_is_not():
    """A section key counts as read where any group's optimizer reads it (Muon's momentum
    beside AdamW); a group's own key only where its optimizer reads it."""
    from components.optimizer.build import check_names

    muon = ParamGroup(pattern="layers", name="Muon")
    check_names(OptimizerConfig(momentum=0.9, param_groups=[muon]))  # Muon reads it
    adamw = ParamGroup(pattern="norm", momentum=0.9)
    with pytest.raises(ConfigError) as refused:
        check_names(OptimizerConfig(param_groups=[adamw]))
    assert str(refused.value) == (
        "[optimizer.param_groups[0]] momentum = 0.9: AdamW takes no momentum, so it would be "
        "ignored; remove it, or use an optimizer that reads it (Muon, SGD)"
    )
