"""A user's own torchft loop around the container, with a plain torch LR scheduler.

    python -m tests.harness.plain_ft REPLICA LIGHTHOUSE STEPS OUT [die AT] [hold STEP FILE]...

No train.py and no project scheduler: a `torch.optim.lr_scheduler.LambdaLR` on an
`FTOptimizersContainer`, healed through torchft's own `register_state_dict_fn`, as a torch
user would write it; its AdamW keeps its moments in 8-bit codes (`LeanAdamW`,
`moment_dtype = "8bit"`), so a heal also carries codes and block scales. Each committed
step appends `{"step", "lr", "params"}` to OUT/replica_REPLICA.jsonl (`params`: every
weight's bytes, hex, so equality is bitwise).
- `die AT`: the process exits (code 3) right after committing step AT, as if killed.
- `hold STEP FILE`: wait before step STEP while FILE exists (the test removes it).
The restarted process writes OUT/ready_REPLICA just before its first quorum.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR
from torchft import Manager
from torchft.process_group import ProcessGroupGloo

from containers import FTOptimizersContainer, LeanAdamW
from tests.harness.helpers import batch, forward, three_parts


def main(argv: list[str]) -> None:
    replica, lighthouse, steps, out = int(argv[0]), argv[1], int(argv[2]), Path(argv[3])
    rest = argv[4:]
    die = int(rest[rest.index("die") + 1]) if "die" in rest else None
    holds = {int(rest[i + 1]): Path(rest[i + 2]) for i, a in enumerate(rest) if a == "hold"}

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    timeout = timedelta(seconds=5)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        timeout=timeout,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        port=0,
        init_sync=False,
    )
    parts = three_parts()
    kwargs = {"lr": 1e-2, "moment_dtype": "8bit"}
    container = FTOptimizersContainer(parts, LeanAdamW, kwargs, ft_manager=manager)
    # Fresh, this scheduler's lr is 1e-2; a healed peer's is far below it.
    scheduler = LambdaLR(container, lambda step: 0.7**step)

    def load(state: dict) -> None:
        for part, weights in zip(parts, state["model"]):
            part.load_state_dict(weights)
        container.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    def save() -> dict:
        return {
            "model": [part.state_dict() for part in parts],
            "optimizer": container.state_dict(),
            "scheduler": scheduler.state_dict(),
        }

    manager.register_state_dict_fn("train", load, save)
    (out / f"ready_{replica}").touch()
    log = (out / f"replica_{replica}.jsonl").open("a")
    while manager.current_step() < steps:
        step = manager.current_step() + 1
        while step in holds and holds[step].exists():
            time.sleep(0.05)
        container.zero_grad()
        forward(parts, batch(step, rank=replica)).square().mean().backward()
        container.step()
        if not container.last_step_committed:
            continue
        # The lr this step used (a heal inside the step may have set it) and its number.
        lr, step = container.param_groups[0]["lr"], manager.current_step()
        scheduler.step()
        weights = b"".join(p.detach().numpy().tobytes() for m in parts for p in m.parameters())
        log.write(json.dumps({"step": step, "lr": lr, "params": weights.hex()}) + "\n")
        log.flush()
        if step == die:
            os._exit(3)
    log.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(sys.argv[1:])
