"""Small models and comparisons shared by the tests."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def three_parts(seed: int = 0) -> list[nn.Module]:
    """A model in 3 parts; 7 rows do not divide by 2, 3 or 4 ranks."""
    torch.manual_seed(seed)
    # Distinct module names keep FQNs unique across parts, as pipeline stages keep theirs.
    return [
        nn.Sequential(OrderedDict(embed=nn.Linear(10, 7), act=nn.Tanh())),
        nn.Sequential(OrderedDict(mid=nn.Linear(7, 9), norm=nn.LayerNorm(9))),
        nn.Sequential(OrderedDict(head=nn.Linear(9, 5))),
    ]


def sharded_three_parts(seed: int = 0) -> list[nn.Module]:
    """`three_parts(seed)`, each part FSDP2-sharded over all ranks (a 1-D CPU mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    parts = three_parts(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for part in parts:
        fully_shard(part, mesh=mesh)
    return parts


def loose_params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    """Leaf tensors of `shapes` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def same_grads(step: int, *params: list[torch.Tensor]) -> None:
    """The same seeded gradients for each list of `params` (contiguous, as backward gives)."""
    g = torch.Generator().manual_seed(100 + step)
    for ps in zip(*params):
        grad = torch.randn(ps[0].shape, generator=g).to(memory_format=torch.contiguous_format)
        for p in ps:
            p.grad = grad.clone()


def forward(parts: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for part in parts:
        x = part(x)
    return x


def batch(step: int, rank: int = 0, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 10, generator=g)


def train(parts: list[nn.Module], opt: Any, steps: int, rank: int = 0, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        forward(parts, batch(step, rank)).square().mean().backward()
        opt.step()


def poisoned_run(parts: list[nn.Module], opt: Any) -> tuple[list, dict[str, Any], list]:
    """Five steps of `opt` (backward through it) where steps 0 and 3 have a NaN loss and step
    2 a NaN gradient of `parts[1].mid.weight` alone: (committed, skipped, partial) of each
    step, then `full_state(opt)` and copies of the weights."""
    dtype = next(parts[0].parameters()).dtype
    reports = []
    for step in range(5):
        opt.zero_grad()
        loss = forward(parts, batch(step).to(dtype)).float().square().mean()
        hook = parts[1].mid.weight.register_hook(lambda g: g * float("nan"))
        if step != 2:
            hook.remove()
        opt.backward(loss * float("nan") if step in (0, 3) else loss)
        opt.step()
        hook.remove()
        report = opt.last_report
        reports.append((report.committed, report.skipped, report.partial))
    return reports, full_state(opt), [p.detach().clone() for m in parts for p in m.parameters()]


def assert_skipped_alike(kernels: tuple, host: tuple, per_unit: bool) -> None:
    """Two `poisoned_run`s, the skips left to the kernels and decided on the host, give the
    same reports (a skip on the first step, a whole step's and, `per_unit`, one unit's while
    the others applied), state and weights."""
    (reports, state, params), (host_reports, host_state, host_params) = kernels, host
    assert reports == host_reports
    assert [r[0] for r in reports] == [False, True, False, False, True]
    assert reports[2][2] is per_unit
    assert_same(state, host_state)
    assert all(torch.equal(a, b) for a, b in zip(params, host_params))


def full(value: Any) -> Any:
    """A plain CPU copy of `value` (DTensors gathered)."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def full_state(container: Any, prefix: str = "") -> dict[str, Any]:
    """`full` copies of the entries of `container.state_dict()` whose keys start with
    `prefix` (e.g. "ema.", "outer.", "master")."""
    return {k: full(v) for k, v in container.state_dict().items() if k.startswith(prefix)}


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """`full` copies of an optimizer's state tensors, keyed `<index>.<name>[.<code key>]`
    (8-bit moments are dicts of codes and scales)."""
    return {
        f"{i}.{name}.{k}": full(v)
        for i, st in opt.state_dict()["state"].items()
        for name, value in st.items()
        for k, v in (value.items() if isinstance(value, dict) else [("", value)])
    }


def lean_compiled(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], compiled: bool
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """`cls` and `kwargs` as `implementation = "compiled"` (or not) builds them: Adam and
    AdamW as their lean classes with `compiled` set, so eager and compiled runs keep the same
    state keys."""
    from containers import LeanAdam, LeanAdamW

    lean = {torch.optim.Adam: LeanAdam, torch.optim.AdamW: LeanAdamW}.get(cls, cls)
    return lean, {**kwargs, "compiled": compiled}


def compiled_calls(monkeypatch: Any) -> list[int]:
    """A list that grows by one at each call of the compiled update's graph (one call a run
    of a tensor: `containers.update.compiled`)."""
    from containers.update import compiled

    graph, calls = compiled._graph(), []

    def counted(*args: Any) -> None:
        calls.append(1)
        graph(*args)

    monkeypatch.setattr(compiled, "_graph", lambda: counted)
    return calls


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal keys and bitwise-equal values (tensors compared element for element)."""
    assert a.keys() == b.keys(), (a.keys() - b.keys(), b.keys() - a.keys())
    for key in a:
        x, y = full(a[key]), full(b[key])
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), key
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x, y), key
        else:
            assert x == y, (key, x, y)


class _FTManagerState:
    """Stands in for a torchft manager's checkpointed state when reading an FT checkpoint."""

    def __init__(self) -> None:
        self.state = {"step": 0, "batches_committed": 0}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


def load_job_state(dump: str, argv: list[str], ft: bool = False) -> dict:
    """Build the job as train.py does, load its newest checkpoint, return gathered state.

    Runs in one process or on the ranks of `tests.harness.dist.run_ranks`; `ft` reads a checkpoint
    of a fault-tolerant run (which also holds the torchft manager's step).
    """
    from components.job import build_job
    from config import load_job_config

    cfg = load_job_config([*argv, "--job.dump_folder", dump, "--fault_tolerance.enable", "false"])
    job = build_job(cfg)
    if ft:
        job.checkpoint.states["ft_manager"] = _FTManagerState()
    job.checkpoint.load(read_only=True)
    job.release_folder()  # the job object outlives this call: let later runs use the folder
    return {
        "model": {k: full(v) for part in job.model_parts for k, v in part.state_dict().items()},
        "optim": {k: full(v) for k, v in job.optimizers.state_dict().items()},
        "lrs": [g["lr"] for g in job.optimizers.param_groups],
        "sample_index": job.dataloader.sample_index,
        "step": job.train_state.step,
        "sched": job.lr_schedulers.last_step,
    }


def train_resumed(argv: list[str]) -> dict:
    """Run `train.main(argv)` on this rank; return its exit code and the state it resumed with.

    The state is gathered (full tensors) at the run's first optimizer step, before any update
    is applied: the optimizer state and weights the checkpoint load gave this rank's layout,
    its lr schedule and train step, and the data position (past the first step's batch).
    The job is train.py's own: `build_job` is only wrapped to keep a handle on it. Runs in one
    process or on the ranks of `tests.harness.dist.run_ranks`.
    """
    import train

    build_job, jobs, resumed = train.build_job, [], {}

    def recording_build_job(cfg: Any) -> Any:
        jobs.append(build_job(cfg))
        # The first inner step (in backward too, under in-backward timing) comes first; the
        # container's own hook where the inner steps bypass `step()` (mixed precision's flat
        # groups).
        jobs[-1].optimizers.register_step_pre_hook(capture)
        for opt in jobs[-1].optimizers.optimizers:
            opt.register_step_pre_hook(capture)
        return jobs[-1]

    def capture(*_: Any) -> None:
        if resumed:
            return
        job = jobs[0]
        resumed["step"] = job.train_state.step
        resumed["optim"] = {k: full(v) for k, v in job.optimizers.state_dict().items()}
        resumed["model"] = {
            k: full(v) for part in job.model_parts for k, v in part.state_dict().items()
        }
        resumed["sched"] = job.lr_schedulers.last_step
        resumed["sample_index"] = job.dataloader.sample_index

    train.build_job = recording_build_job
    try:
        code = train.main(argv)
    finally:
        train.build_job = build_job
    return {"code": code, **resumed}


def poison(step_dir: Path, word: str, last: bool = False) -> str:
    """Set one element of the first (or `last`) floating-point tensor of the checkpoint
    `step_dir` whose flat key holds `word` to NaN, as a damaged or hand-edited checkpoint holds
    it: the folder is rewritten by one process through DCP. Returns the key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "all.pt"
        dcp_to_torch_save(step_dir, whole)
        nested = torch.load(whole, weights_only=False)
    flat, _ = flatten_state_dict(nested)  # views of `nested`'s tensors
    keys = [
        k
        for k, v in flat.items()
        if word in k and isinstance(v, torch.Tensor) and v.is_floating_point()
    ]
    key = keys[-1 if last else 0]
    flat[key].view(-1)[0] = float("nan")
    shutil.rmtree(step_dir)
    dcp.save(nested, checkpoint_id=step_dir, no_dist=True)
    return key


_PLAN_ROW = re.compile(
    r"^\| `(?P<name>[^`]+)` \| (?P<masters>[^|]+) \| (?P<moments>[^|]+) \| "
    r"(?P<driver>[^|]+) \| [^|]+ \| (?P<logged>[^|]+) \|$"
)


def plan_table() -> list[dict[str, str]]:
    """The rows of ARCHITECTURE.md's table of update plans (name, codecs, driver, configs)."""
    text = (Path(__file__).resolve().parents[2] / "ARCHITECTURE.md").read_text()
    section = text.split("## Update plans", 1)[1].split("\n## ", 1)[0]
    return [m.groupdict() for line in section.splitlines() if (m := _PLAN_ROW.match(line))]


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes (whole pages) mounted at `path`: a disk that fills up. Skips the
    test where mounting needs a root this machine does not give."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    try:
        done = subprocess.run(mount, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e}): the full-disk case needs one")
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
