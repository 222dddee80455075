"""DiLoCo: local inner steps, an outer step every `sync_steps`, outer state in the flat dict."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from components.checkpoint import ModelWrapper
from containers import DiLoCo, OptimizersContainer, ShadowWeights
from containers.outer import OtherFragments
from containers.tensors import shaped_like
from tests.containers.gate.test_fault_tolerant import one_group
from tests.harness.ftjob import FTJob
from tests.harness.helpers import (
    assert_same,
    full,
    full_state,
    sharded_three_parts,
    three_parts,
    train,
)

KW = {"lr": 1e-2, "weight_decay": 0.1}


@pytest.fixture
def manager(tmp_path, monkeypatch):
    """One replica group's synchronous-quorum manager (DiLoCo's), a real lighthouse."""
    with one_group(tmp_path, monkeypatch, semi_sync_method="diloco") as ft_manager:
        yield ft_manager


def _params(parts) -> list[torch.Tensor]:
    return [full(p) for part in parts for p in part.parameters()]


def test_inner_steps_are_local_and_every_sync_steps_the_outer_nesterov_step_lands(manager):
    """One replica group with a real lighthouse (the average of one group is its own
    pseudo-gradient): the weights are the reference DiLoCo's, written out by hand, at
    every step, and they move between syncs; an EMA of them folds in the weights after the
    outer step."""
    parts, ref_parts = three_parts(), three_parts()
    diloco, ema = DiLoCo(manager, sync_steps=3), ShadowWeights(0.5)
    opt = OptimizersContainer(parts, torch.optim.AdamW, KW, outer=diloco, ema=ema)
    ref = OptimizersContainer(ref_parts, torch.optim.AdamW, KW)
    weights = [p for g in ref.param_groups for p in g["params"]]
    global_ = [p.detach().clone() for p in weights]
    outer = torch.optim.SGD(global_, lr=0.7, momentum=0.9, nesterov=True)
    before, ref_ema = _params(parts), [w.detach().clone() for w in weights]
    for step in range(7):
        train(parts, opt, 1, start=step)
        train(ref_parts, ref, 1, start=step)
        if (step + 1) % 3 == 0:
            for g, w in zip(global_, weights):
                g.grad = g.detach() - w.detach()
            outer.step()
            with torch.no_grad():
                for w, g in zip(weights, global_):
                    w.copy_(g)
        for e, w in zip(ref_ema, weights):
            e.lerp_(w.detach(), 0.5)
        assert all(torch.equal(a, b) for a, b in zip(ema.averages(), ref_ema)), step
        now = _params(parts)
        assert all(torch.equal(a, b) for a, b in zip(now, _params(ref_parts))), step
        assert not all(torch.equal(a, b) for a, b in zip(now, before)), step
        before = now
    state = opt.state_dict()
    assert state["outer.inner_steps"] == 7 and state["outer.outer_steps"] == 2
    assert torch.equal(
        state["outer.state.head.weight.momentum_buffer"],
        outer.state[global_[-2]]["momentum_buffer"],
    )


def _run(manager, parts, steps: range, path=None, load=None, delay=0):
    diloco = DiLoCo(manager, sync_steps=3, fragment_sync_delay=delay)
    opt = OptimizersContainer(parts, torch.optim.AdamW, KW, outer=diloco)
    states = {"model": ModelWrapper(parts), "optim": opt}
    if load is not None:  # as the checkpoint manager loads: the template fitted to the keys
        keys = dcp.FileSystemReader(load).read_metadata().state_dict_metadata
        opt.check_checkpoint_keys([k.removeprefix("optim.") for k in keys])
        dcp.load(states, checkpoint_id=load)
    train(parts, opt, len(steps), start=steps.start)
    if path is not None:
        dcp.save(states, checkpoint_id=path)
    return opt


@pytest.mark.parametrize(("delay", "stop"), [(0, 4), (1, 5)], ids=["delay0", "delay1_in_flight"])
def test_a_restart_in_the_middle_of_an_inner_period_goes_on_bitwise(manager, tmp_path, delay, stop):
    """Saved one inner step into the second period (delay 0), or with the second average
    taken and waiting to land (delay 1: averaged after step 5, lands after 6), loaded into a
    fresh container as a template (outer momentum included), on to step 8: the same weights
    and state as 8 steps without a stop."""
    straight = three_parts()
    whole = _run(manager, straight, range(8), delay=delay)
    path = str(tmp_path / "ckpt")
    saved = _run(manager, three_parts(), range(stop), path=path, delay=delay)
    assert saved.state_dict()["outer.in_flight"] == (0 if delay else -1)
    resumed_parts = three_parts(seed=1)
    resumed = _run(manager, resumed_parts, range(stop, 8), load=path, delay=delay)
    assert_same(
        {k: full(v) for k, v in resumed.state_dict().items()},
        {k: full(v) for k, v in whole.state_dict().items()},
    )
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed_parts), _params(straight)))


@pytest.mark.parametrize(
    ("layout", "nproc"),
    [
        # each pipeline stage syncs its own parameters in the same quorum, the outer step on
        # their fp32 masters, inner moments and outer momentum in bf16
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--optimizer.container",
                "mixed_precision",
                "--optimizer.moment_dtype",
                "bfloat16",
            ],
            2,
        ),
        # the global weights DTensors sharded as their parameters; inner moments in 8-bit
        # codes (bf16 where a column cut splits a block), the outer momentum in bf16
        (["--parallelism.tensor_parallel_degree", "2", "--optimizer.moment_dtype", "8bit"], 2),
    ],
    ids=["pp2_mixed_precision_bf16_moments", "tp2_8bit"],
)
@pytest.mark.slow
def test_two_replica_groups_agree_at_every_sync_and_part_ways_between(tmp_path, layout, nproc):
    """Two groups through train.py with a real lighthouse (which waits for both): each reads
    its own data, so their weights differ after every inner step and are the same after
    every outer step; no step is uncommitted."""
    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"]
    job = FTJob(tmp_path, 12, [*args, *layout], nproc=nproc, min_replicas=2)
    job.run_both()
    _agree_at_every_sync(job)
    if "8bit" in layout:
        saved = dcp.FileSystemReader(str(tmp_path / "replica_0/checkpoint/step-12"))
        meta = saved.read_metadata().state_dict_metadata
        dtypes = lambda end: {v.properties.dtype for k, v in meta.items() if k.endswith(end)}  # noqa: E731
        assert dtypes("exp_avg_sq.code") == {torch.uint8}  # inner: codes
        assert dtypes("momentum_buffer") == {torch.bfloat16}  # outer: bf16


def _agree_at_every_sync(job: FTJob) -> None:
    """Both groups committed every step of 12; their weights are the same after every outer
    step (4, 8, 12) and differ after every inner one (each reads its own data)."""
    ours, theirs = job.metrics(0), job.metrics(1)
    assert sorted(ours) == sorted(theirs) == list(range(1, 13))
    for step in ours:
        same = ours[step]["param_checksum"] == theirs[step]["param_checksum"]
        assert same == (step % 4 == 0), (step, ours[step], theirs[step])
    assert "not committed" not in job.log("replica_0") + job.log("replica_1")


def _two_groups(job: FTJob, script: tuple[str, ...] = ("train.py",)) -> None:
    for r in (0, 1):
        job.start_replica(r, script)


@pytest.mark.slow
def test_a_two_group_job_restarted_in_the_middle_of_an_inner_period_goes_on_bitwise(tmp_path):
    """Masters kept as remainders, 8-bit moments; fragment_sync_delay 2: averages after
    steps 2, 6, 10 land after 4, 8, 12. A run that never stops agrees at every sync and parts
    ways between (an average taken steps before it lands). Both groups of a second run save
    at step 6 (an average waiting to land) and are killed while held at step 7; restarted,
    they resume from step-6 and reach the same weights at steps 8 (a sync), 10 and 12 as the
    run that never stopped."""
    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"]
    args += ["--fault_tolerance.fragment_sync_delay", "2"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "6"]
    # the leanest state: bf16 weights, masters kept as remainders, 8-bit moments
    args += ["--optimizer.container", "mixed_precision", "--optimizer.moment_dtype", "8bit"]
    args += ["--mixed_precision.store_param_remainders"]
    (tmp_path / "straight").mkdir(), (tmp_path / "stopped").mkdir()
    straight = FTJob(tmp_path / "straight", 12, args, min_replicas=2)
    straight.run_both()
    _agree_at_every_sync(straight)
    job = FTJob(tmp_path / "stopped", 12, args, min_replicas=2)
    hold = tmp_path / "hold"
    hold.touch()
    try:
        _two_groups(job, ("-m", "tests.harness.faults", "hold", "7", str(hold)))
        saved = [job.folder / f"replica_{r}" / "checkpoint" / "step-6" for r in (0, 1)]
        job.wait_for("step-6 on both", lambda: all(s.is_dir() for s in saved))
        for r in (0, 1):
            job.kill(f"replica_{r}")
        _two_groups(job)
        assert [job.wait_exit(f"replica_{r}") for r in (0, 1)] == [0, 0], job.tails()
    finally:
        job.close()
    for r in (0, 1):
        assert f"resumed from {saved[r]}" in job.log(f"replica_{r}")
        before, after = straight.metrics(r), job.metrics(r)
        for step in (8, 10, 12):
            assert after[step]["param_checksum"] == before[step]["param_checksum"], (r, step)
    assert job.metrics(0)[8]["param_checksum"] == job.metrics(1)[8]["param_checksum"]


@pytest.mark.slow
def test_a_group_killed_mid_inner_period_restarts_fresh_and_heals_at_the_next_sync(tmp_path):
    """fragment_sync_delay 1: averages after steps 3, 7, 11 land after 4, 8, 12. Group 1 is
    killed at step 6; group 0 goes on alone and waits at its average after step 7.
    Restarted with nothing on disk, group 1 reaches its own first average, heals there from
    group 0 (weights, outer state, schedule, step; its row of that step has no loss and no
    grad_norm, both from before the heal), averages with it and both end bitwise equal."""
    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"]
    args += ["--fault_tolerance.fragment_sync_delay", "1"]
    job = FTJob(tmp_path, 12, args, min_replicas=2)
    hold = tmp_path / "hold"
    hold.touch()
    try:
        job.start_replica(0)
        job.start_replica(1, ("-m", "tests.harness.faults", "hold", "6", str(hold)))
        job.wait_for("group 1 at step 5", lambda: max(job.metrics(1), default=0) >= 5)
        job.kill("replica_1")
        restarted_at = len(job.log("replica_1"))
        job.start_replica(1)
        codes = [job.wait_exit(f"replica_{r}") for r in (0, 1)]
    finally:
        job.close()
    assert codes == [0, 0], job.tails()
    ours, theirs = job.metrics(0), job.metrics(1)
    # It heals at its first sync: the row of that step has no loss and, its own inner
    # step's gradient being from before the heal, no grad_norm either.
    step = job.healed_row(restarted_at, ours, theirs)
    assert step == 7, step
    assert "grad_norm" not in theirs[step] and "or grad_norm" in theirs[step]["note"]
    assert ours[12]["param_checksum"] == theirs[12]["param_checksum"]
    assert ours[10]["param_checksum"] != theirs[10]["param_checksum"]  # inner steps: apart
    # The late joiner does not spike the loss: on healed weights from step 8 on (its first
    # step after its first average), its mean loss is its peer's (each reads its own data),
    # nowhere near a fresh start's.
    mean = [sum(m[s]["loss"] for s in range(8, 13)) / 5 for m in (ours, theirs)]
    assert abs(mean[1] / mean[0] - 1) < 0.05, mean
    assert max(theirs[s]["loss"] for s in range(8, 13)) < 0.8 * theirs[1]["loss"]


def _sharded(seed: int) -> tuple[list, OptimizersContainer, DiLoCo]:
    parts = sharded_three_parts(seed)
    diloco = DiLoCo(None, sync_steps=10**9)  # state only: the outer step is called by hand
    return parts, OptimizersContainer(parts, torch.optim.AdamW, KW, outer=diloco), diloco


def _average_alone(diloco: DiLoCo) -> None:
    """One replica group's average of its one fragment (its own pseudo-gradients), as
    `DiLoCo._average` keeps it when committed: waiting to land."""
    (members,) = diloco.fragments
    diloco.in_flight = 0
    averages = zip(members, diloco.pseudo_gradients(members))
    diloco.pending = {i: shaped_like(x, diloco.global_[i]) for i, x in averages}


def _save_outer(path: str) -> dict:
    import torch.distributed as dist

    parts, opt, diloco = _sharded(0)
    for step in range(3):
        train(parts, opt, 1, start=step, rank=dist.get_rank())
        _average_alone(diloco)
        diloco._land(0)
    _average_alone(diloco)  # the next average, saved while it waits to land
    train(parts, opt, 1, start=3, rank=dist.get_rank())
    dcp.save({"optim": opt}, checkpoint_id=path)
    return full_state(opt, "outer.")


def _load_outer(path: str) -> dict:
    _, opt, diloco = _sharded(1)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    with pytest.raises(ValueError, match=r"fragment 0's average waits to land but .*pending"):
        dcp.load({"optim": opt}, checkpoint_id=path)  # a template without the average
    assert diloco.in_flight == -1 and diloco.outer_steps == 0  # the failed load changed nothing
    opt.check_checkpoint_keys([k.removeprefix("optim.") for k in keys])
    dcp.load({"optim": opt}, checkpoint_id=path)
    return full_state(opt, "outer.")


def test_the_outer_state_saved_on_2_fsdp2_ranks_loads_on_1_element_for_element(tmp_path):
    from tests.harness.dist import run_ranks

    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _save_outer, path)[0]
    assert saved["outer.outer_steps"] == 3 and "outer.state.head.weight.momentum_buffer" in saved
    assert saved["outer.in_flight"] == 0 and "outer.pending.head.weight" in saved
    assert_same(run_ranks(1, _load_outer, path)[0], saved)


@pytest.mark.parametrize("delay", [0, 1])
def test_streaming_fragments_sync_in_turn_as_written_out_by_hand(manager, delay):
    """Two fragments, sync_steps 4, fragment_update_alpha 0.5, one replica group with a real
    lighthouse: the first fragment lands after steps 2, 6, the second after 4, 8, each with
    the outer step on its own global weights only, the local ones mixed half and half; with
    fragment_sync_delay 1 its pseudo-gradients are those of the step before."""
    parts, ref_parts = three_parts(), three_parts()
    diloco = DiLoCo(
        manager, sync_steps=4, num_fragments=2, fragment_sync_delay=delay,
        fragment_update_alpha=0.5,
    )  # fmt: skip
    opt = OptimizersContainer(parts, torch.optim.AdamW, KW, outer=diloco)
    ref = OptimizersContainer(ref_parts, torch.optim.AdamW, KW)
    weights = [p for g in ref.param_groups for p in g["params"]]
    global_ = [p.detach().clone() for p in weights]
    outer = torch.optim.SGD(global_, lr=0.7, momentum=0.9, nesterov=True)
    first, second = diloco.fragments
    assert first and second and sorted(first + second) == list(range(len(weights)))
    lands = {2: first, 6: first, 4: second, 8: second}
    for step in range(1, 9):
        train(parts, opt, 1, start=step)
        train(ref_parts, ref, 1, start=step)
        for i in lands.get(step + delay, []):
            global_[i].grad = global_[i].detach() - weights[i].detach()
        if step in lands:
            outer.step()
            outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for i in lands[step]:
                    weights[i].lerp_(global_[i], 0.5)
        assert all(torch.equal(a, b) for a, b in zip(_params(parts), _params(ref_parts))), step
        # With the delay, each average is on its way over the inner step that follows it.
        assert (diloco._flight is not None) == (step + delay in lands and step not in lands)
    assert opt.state_dict()["outer.outer_steps"] == 4


@pytest.mark.slow
def test_two_groups_stream_two_fragments_each_agreeing_after_its_own_sync(tmp_path):
    """Through train.py, 12 steps, sync_steps 4, 2 fragments: the fragment synced after step
    12 is the same in both groups' last checkpoints; the other, synced after step 10, is not
    (two inner steps since)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"]
    args += ["--fault_tolerance.num_fragments", "2", "--checkpoint.enable"]
    job = FTJob(tmp_path, 12, args, min_replicas=2)
    job.run_both()
    saved = []
    for r in (0, 1):
        dcp_to_torch_save(
            tmp_path / f"replica_{r}" / "checkpoint" / "step-12", tmp_path / f"{r}.pt"
        )
        saved.append(torch.load(tmp_path / f"{r}.pt", weights_only=False))
    fragment = {
        k.removeprefix("outer.fragment."): v
        for k, v in saved[0]["optimizer"].items()
        if k.startswith("outer.fragment.")
    }
    assert set(fragment.values()) == {0, 1}
    for fqn, f in fragment.items():
        same = torch.equal(saved[0]["model"][fqn], saved[1]["model"][fqn])
        assert same == (f == 1), (fqn, f)


def test_a_checkpoint_of_other_fragments_is_refused_by_name_and_changes_nothing(manager):
    parts = three_parts()
    two = OptimizersContainer(
        parts, torch.optim.AdamW, KW, outer=DiLoCo(manager, sync_steps=4, num_fragments=2)
    )
    train(parts, two, 1)
    saved = two.state_dict()
    other_parts = three_parts(seed=1)
    one = OptimizersContainer(
        other_parts, torch.optim.AdamW, KW, outer=DiLoCo(manager, sync_steps=4)
    )
    before = {k: full(v) for k, v in one.state_dict().items()}
    with pytest.raises(OtherFragments, match=r"num_fragments = 1, the checkpoint's 2: parameters"):
        one.load_state_dict(saved)
    assert_same({k: full(v) for k, v in one.state_dict().items()}, before)


def test_train_py_refuses_a_checkpoint_of_other_fragments_in_one_line_before_training(tmp_path):
    """Saved with 2 fragments, resumed with 1 (a real lighthouse): exit 2 and one line naming
    the key, both values and the fix, before step 1; no file of the run changes."""
    import hashlib

    from tests.containers.gate.test_fault_tolerant import _errors

    def files() -> dict[str, str]:
        dump = tmp_path / "replica_0"  # train.log says why; the run lock records each run
        return {
            str(f.relative_to(dump)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(dump.rglob("*"))
            if f.is_file() and f.name not in ("train.log", "run.lock")
        }

    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"]
    args += ["--fault_tolerance.num_fragments", "2", "--checkpoint.enable"]
    job = FTJob(tmp_path, 4, args)
    try:
        job.start_replica(0)
        assert job.wait_exit("replica_0") == 0, job.tails()
        before, logged = files(), len(job.log("replica_0"))
        assert "checkpoint/step-4/.metadata" in before
        job.args += ["--fault_tolerance.num_fragments", "1", "--training.steps", "8"]
        job.start_replica(0)
        assert job.wait_exit("replica_0") == 2, job.tails()
    finally:
        job.close()
    log = job.log("replica_0")[logged:]
    step4 = tmp_path / "replica_0" / "checkpoint" / "step-4"
    [line] = _errors(log)
    assert (
        f"error: [fault_tolerance] num_fragments = 1: the checkpoint {step4} was trained with "
        "num_fragments = 2 (each parameter keeps its fragment's sync schedule); resume with "
        "--fault_tolerance.num_fragments 2, or start a new dump folder"
    ) in line, log
    assert not re.search(r"INFO (\[group \d+\] )?step ", log), log  # refused before step 1
    assert files() == before and sorted(job.metrics(0)) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_group_with_another_outer_lr_is_refused_at_its_first_sync_the_live_one_trains_on(
    tmp_path,
):
    """Group 0 syncs alone at step 4 and is held at step 8 until group 1 is up; group 1
    starts with another outer lr: at the sync they share it is refused in one line naming
    the key (exit 2, nothing committed or saved), and group 0 trains on alone to the end."""
    from tests.containers.gate.test_fault_tolerant import _errors

    args = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"]
    # The group first at a sync waits there for the other, however slow the machine: the
    # lighthouse waits for a live group to join (no race with a short join timeout).
    job = FTJob(tmp_path, 12, args, join_timeout_ms=60_000)
    codes = job.join_late(8, ["--fault_tolerance.outer_lr", "0.5"], released_at=3)
    assert codes == (0, 2), job.tails()
    [line] = _errors(job.log("replica_1"))
    assert "error: replica group replica_1 refused before it committed anything" in line
    assert "[fault_tolerance] outer_lr = 0.5 (replica_0: 0.7)" in line, line
    assert not list((tmp_path / "replica_1").glob("checkpoint/step-*"))
    assert sorted(job.metrics(0)) == list(range(1, 13))


def test_the_outer_momentum_follows_the_lean_moment_dtype_and_the_global_weights_stay_fp32(
    manager,
):
    """`[optimizer] moment_dtype = "bfloat16"`: the outer Nesterov momentum is kept in bf16
    too (torch's SGD on the widened buffer, rounded back), the global weights in fp32."""
    from components.ft import build_outer
    from config import load_job_config

    args = ["--fault_tolerance.enable", "--fault_tolerance.semi_sync_method", "diloco"]
    args += ["--fault_tolerance.sync_steps", "2", "--optimizer.moment_dtype", "bfloat16"]
    diloco = build_outer(load_job_config(args), manager)
    parts = three_parts()
    opt = OptimizersContainer(parts, torch.optim.AdamW, KW, outer=diloco)
    train(parts, opt, 2)
    state = opt.state_dict()
    assert state["outer.outer_steps"] == 1
    assert state["outer.state.head.weight.momentum_buffer"].dtype == torch.bfloat16
    assert state["outer.global.head.weight"].dtype == torch.float32


def test_an_outer_optimizer_without_lean_state_keeps_fp32_state_beside_lean_inner_moments():
    """The inner `moment_dtype = "bfloat16"` makes the outer state lean only where the outer
    optimizer has lean state: Adagrad keeps its fp32 sums (it was refused under a key
    `[fault_tolerance] outer_optimizer: moment_dtype` that does not exist, after torchft
    connected)."""
    from components.ft import build_outer
    from components.job import validate_job
    from config import load_job_config

    args = ["--fault_tolerance.enable", "--fault_tolerance.semi_sync_method", "diloco"]
    args += ["--fault_tolerance.lighthouse", "http://127.0.0.1:1"]  # never contacted
    args += ["--fault_tolerance.outer_optimizer", "Adagrad", "--optimizer.moment_dtype=bfloat16"]
    cfg = load_job_config(args)
    validate_job(cfg)
    diloco = build_outer(cfg, SimpleNamespace(_use_async_quorum=False))
    assert diloco.outer_cls is torch.optim.Adagrad and "moment_dtype" not in diloco.outer_kwargs


@pytest.mark.parametrize("delay", [0, 1])
def test_masters_kept_as_remainders_sync_as_fp32_masters_bitwise(manager, delay):
    """The outer step reads each master decoded from its bf16 parameter and remainder and
    writes it back split again: fed the same gradients over two syncs, the global weights,
    outer momentum, masters and parameters are those of fp32 masters, bit for bit."""
    from containers import MasterWeights, MixedPrecisionOptimizersContainer, MixedPrecisionSettings

    states = []
    for keep in (False, True):
        precision = MasterWeights(MixedPrecisionSettings(store_param_remainders=keep))
        parts = [precision.cast_model(p) for p in three_parts()]
        opt = MixedPrecisionOptimizersContainer(
            parts, torch.optim.AdamW, {**KW, "fused": True}, precision=precision,
            outer=DiLoCo(manager, sync_steps=3, fragment_sync_delay=delay),
        )  # fmt: skip
        params = [p for part in parts for p in part.parameters()]
        g = torch.Generator().manual_seed(3)
        for _ in range(7):
            opt.zero_grad()
            grads = [torch.randn(p.shape, generator=g).bfloat16() for p in params]
            sum((p.float() * d.float()).sum() for p, d in zip(params, grads)).backward()
            opt.step()
        state = {k: full(v) for k, v in opt.state_dict().items()}
        assert state["outer.outer_steps"] == 2
        states.append((state, [p.detach().clone() for p in params]))
    assert_same(states[0][0], states[1][0])
    assert all(torch.equal(a, b) for a, b in zip(states[0][1], states[1][1]))
