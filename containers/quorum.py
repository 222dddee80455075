"""Replica groups at a torchft quorum: waiting for it (`wait_quorum`) and agreeing on the
settings that shape their math (`SettingsAgreement`); shared by `TorchFTGate` and `DiLoCo`.

Groups average their gradients, so one with another lr, clip or schedule would corrupt the
others, and healing cannot catch groups that start together: at each new quorum every group
all-gathers its settings, and one that differs from the first training group leaves before
it loads a peer's state or commits anything.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from containers.parts import GateLost

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["SettingsAgreement", "SettingsMismatch", "wait_quorum"]

logger = logging.getLogger(__name__)


def wait_quorum(manager: Manager, start: bool = False) -> None:
    """Wait for `manager`'s quorum (`start`: start it too, for a synchronous-quorum manager).

    Warns once after the connect timeout and keeps waiting (a lighthouse may restart).

    Raises:
        GateLost: no quorum within torchft's timeout; nothing of the step changed yet.
    """
    connect = getattr(manager, "_connect_timeout", None)
    quorum = getattr(manager, "_quorum_timeout", None)

    def warn() -> None:
        logger.warning(
            "torchft: no quorum of replica groups after %g s (the lighthouse unreachable, or "
            "groups still joining); waiting up to the quorum timeout%s",
            connect.total_seconds(),
            f" ({quorum.total_seconds():g} s)" if quorum is not None else "",
        )

    timer = None
    try:
        if start:  # (it waits inside start_quorum: the warning comes from a timer thread)
            if connect is not None:
                timer = threading.Timer(connect.total_seconds(), warn)
                timer.daemon = True
                timer.start()
            manager.start_quorum()
        # (every step's quorum, started already: waited on here, no thread per step)
        elif (
            connect is not None
            and (future := getattr(manager, "_quorum_future", None)) is not None
            and concurrent.futures.wait([future], timeout=connect.total_seconds()).not_done
        ):
            warn()
        manager.wait_quorum()
    except Exception as e:
        within = f" within {quorum.total_seconds():g} s" if quorum is not None else ""
        # torchft's own text is a gRPC status dump; its type says enough.
        raise GateLost(
            f"torchft found no quorum of replica groups{within} ({type(e).__name__}): "
            "the lighthouse is gone or unreachable"
        ) from None
    finally:
        if timer is not None:
            timer.cancel()


class SettingsMismatch(ValueError):
    """This replica group's settings differ from the reference group's (one-line message)."""


class SettingsAgreement:
    """The settings of one replica group, compared with its peers' at each new quorum.

    Args:
        name: the group's name in messages (e.g. "replica_1").
        settings: key -> value (JSON-serializable) that every group must share.
    """

    def __init__(self, name: str, settings: Mapping[str, Any]) -> None:
        self.name = name
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
        if getattr(manager, "_group_rank", 0) == 0:
            for group in refused:
                logger.warning(
                    "replica group %s refused (its config differs in %s); training on without it",
                    group["name"],
                    _differences(group["settings"], self.settings, self.name),
                )
        return len(groups) - len(refused)


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
