"""Replica groups agreeing on the config settings that shape their math.

Groups average their (pseudo-)gradients, so at each new quorum a group whose settings differ
from the first training group's leaves before it loads a peer's state or commits anything.
`SettingsAgreement.check` is what `TorchFTGate` and `DiLoCo` call there (`agreement=`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from containers.quorum import lighthouse_address, lighthouse_status, min_replicas_wait

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["SettingsAgreement", "SettingsMismatch"]

logger = logging.getLogger(__name__)


class SettingsMismatch(ValueError):
    """This replica group's settings differ from the reference group's (one-line message)."""


class SettingsAgreement:
    """The settings of one replica group, compared with its peers' at each new quorum.

    Args:
        name: the group's name in messages (e.g. "replica_1").
        settings: key -> value (JSON-serializable) that every group must share.
        lighthouse: the lighthouse's address (None: `TORCHFT_LIGHTHOUSE`), asked whether
            the groups left after a refusal are enough for its `min_replicas`.
    """

    def __init__(
        self, name: str, settings: Mapping[str, Any], lighthouse: str | None = None
    ) -> None:
        self.name = name
        self.lighthouse = lighthouse
        # As a peer receives them, so that equal settings compare equal.
        self.settings = json.loads(json.dumps(dict(settings)))
        self._agreed_quorum: object = None

    def check(self, manager: Manager) -> int | None:
        """Compare with every group of `manager`'s current quorum (once per quorum).

        Returns None when all agree, else the number of groups left once those that differ
        are refused (then no collective on this quorum's process group runs this step).

        Raises:
            SettingsMismatch: this group's settings differ from the reference group's.
        """
        quorum = getattr(manager, "_quorum_id", None)  # torchft has no public accessor
        if quorum is not None and quorum == self._agreed_quorum:
            return None
        if manager.errored() is not None:  # e.g. the quorum's process group failed to start
            return None  # the step commits nowhere; compared in the next quorum
        pg = manager._pg  # torchft's replica process group, reconfigured per quorum
        if pg.size() == 1:
            self._agreed_quorum = quorum
            return None
        mine = {
            "name": self.name,
            "step": manager.current_step(),
            # False while healing: a group that joins is not the reference, whatever its step.
            "live": manager.is_participating(),
            "settings": self.settings,
        }
        try:
            groups = _all_gather_json(pg, mine)
        except Exception as e:  # a peer died mid-collective: this step commits nowhere
            manager.report_error(e)
            return None  # compared again in the next quorum
        ref = next((g for g in groups if g["live"]), groups[0])
        refused = [g for g in groups if g["settings"] != ref["settings"]]
        if not refused:
            self._agreed_quorum = quorum
            return None
        if self.settings != ref["settings"]:
            raise SettingsMismatch(
                f"replica group {self.name} refused before it committed anything: its config "
                f"differs from replica group {ref['name']}'s (at step {ref['step']}) in "
                f"{_differences(self.settings, ref['settings'], ref['name'])}; replica groups "
                f"average their (pseudo-)gradients, so they must train the same math: start "
                f"it with {ref['name']}'s values"
            )
        left = len(groups) - len(refused)
        if getattr(manager, "_group_rank", 0) == 0:
            after = self._without(manager, left, ref["name"])
            for group in refused:
                logger.warning(
                    "replica group %s refused (its config differs in %s); %s",
                    group["name"],
                    _differences(group["settings"], self.settings, self.name),
                    after,
                )
        return left

    def _without(self, manager: Manager, left: int, ref: str) -> str:
        """What the `left` groups do once the others are refused: train on, unless the
        lighthouse says it needs more groups for a quorum (its `min_replicas`)."""
        status = lighthouse_status(self.lighthouse)
        if status is None:
            where = lighthouse_address(self.lighthouse) or "(address unknown)"
            return (
                f"training on without it once the lighthouse at {where} (not answering now) "
                "forms a quorum of the groups left"
            )
        waits = min_replicas_wait(status)
        need = waits[1] if waits is not None else 0
        if left >= need:  # (a status that names no min_replicas has enough groups joined)
            return "training on without it"
        quorum = getattr(manager, "_quorum_timeout", None)
        within = f" up to the quorum timeout, {quorum.total_seconds():g} s" if quorum else ""
        groups = f"{left} replica group is" if left == 1 else f"{left} replica groups are"
        return (
            f"the lighthouse needs min_replicas {need} replica groups for a quorum and "
            f"{groups} left: no quorum until another joins (waiting{within}, then "
            f"stopping); start one with {ref}'s config, or restart the lighthouse with "
            f"--min_replicas {left}"
        )


def _differences(theirs: Mapping[str, Any], ours: Mapping[str, Any], our_name: str) -> str:
    """`key = theirs (our_name: ours)` for every key whose values differ."""
    keys = sorted(set(theirs) | set(ours))
    return ", ".join(
        f"{k} = {json.dumps(theirs.get(k))} ({our_name}: {json.dumps(ours.get(k))})"
        for k in keys
        if theirs.get(k) != ours.get(k)
    )


def _all_gather_json(pg: Any, obj: Any) -> list[Any]:
    """`obj` of every rank of `pg`, in rank order (JSON over uint8: tensor collectives only)."""
    data = json.dumps(obj).encode()
    n = pg.size()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    pg.allgather([sizes], [size], AllgatherOptions()).wait()
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    pg.allgather([everyone], [mine], AllgatherOptions()).wait()
    return [
        json.loads(bytes(t[: int(s.item())].tolist()).decode())
        for t, s in zip(everyone, sizes, strict=True)
    ]
