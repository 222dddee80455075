"""Your own training loop as one torchft replica group: the container averages the gradients
across groups, steps only when torchft commits, and a restarted group heals from a live peer.
With SYNC_STEPS above 0 the groups run DiLoCo instead: SYNC_STEPS local steps, then an outer
step on the averaged pseudo-gradients.

    .venv/bin/python examples/torchft_loop.py REPLICA_ID [LIGHTHOUSE] [STEPS] [SYNC_STEPS]

Start a lighthouse first (`docs/fault-tolerance.md`); each group is one process here.
"""

import os
import sys
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side: warnings only (read on import)

import torch
from torch import nn
from torchft import Manager
from torchft.process_group import ProcessGroupGloo

from containers import DiLoCo, FTOptimizersContainer, OptimizersContainer

replica = int(sys.argv[1])
lighthouse = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:29510"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
sync_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 0

store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)  # this group's own store
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
timeout = timedelta(seconds=10)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timeout),  # the process group across replica groups
    load_state_dict=None,  # registered below, once the container exists
    state_dict=None,
    min_replica_size=1,
    timeout=timeout,
    rank=0,
    world_size=1,
    lighthouse_addr=lighthouse,
    replica_id=f"replica_{replica}",
    port=0,
    init_sync=False,  # every group starts from the same seed
    use_async_quorum=sync_steps == 0,  # DiLoCo heals at the sync's quorum
)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
if sync_steps == 0:  # every step: gradients averaged across groups, commit or retry
    outer = None
    optimizers = FTOptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, ft_manager=manager)
else:  # DiLoCo: local steps, an outer Nesterov SGD step every sync_steps
    outer = DiLoCo(
        manager, sync_steps=sync_steps, outer_kwargs={"lr": 0.7, "momentum": 0.9, "nesterov": True}
    )
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, outer=outer)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizers, lambda step: 0.99**step)


def load(state: dict) -> None:  # a healing group takes its peer's state
    model.load_state_dict(state["model"])
    optimizers.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


def save() -> dict:  # built when a peer asks, never cached
    return {
        "model": model.state_dict(),
        "optimizer": optimizers.state_dict(),
        "scheduler": scheduler.state_dict(),
    }


manager.register_state_dict_fn("train", load, save)


def steps_done() -> int:  # committed steps (torchft's count) or DiLoCo's inner steps; both heal
    return manager.current_step() if sync_steps == 0 else outer.inner_steps


while steps_done() < steps:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * replica + steps_done()))
    optimizers.zero_grad()  # starts the quorum, which runs during forward
    loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
    optimizers.backward(loss)
    optimizers.step()  # every step: average across groups, apply only if torchft commits
    if optimizers.last_step_committed:  # not committed: the same batch again
        scheduler.step()
        print(f"replica {replica} step {steps_done()} loss {loss.item():.4f}")
checksum = sum(p.double().sum().item() for p in model.parameters())
print(f"replica {replica} done: parameter checksum {checksum!r}")
manager.shutdown(wait=False)
