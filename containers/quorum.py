"""Replica groups at a torchft quorum (shared by `TorchFTGate` and `DiLoCo`): waiting for it
(`wait_quorum`), and agreeing on the settings that shape their math (`SettingsAgreement`):
groups average their gradients, so at each new quorum one whose settings differ from the first
training group's leaves before it loads a peer's state or commits anything. A message about a
missing quorum quotes the lighthouse's own `/status` (`lighthouse_status`).
"""

from __future__ import annotations

import concurrent.futures
import html
import http.client
import json
import logging
import os
import re
import threading
import urllib.request
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from containers.parts import GateLost

if TYPE_CHECKING:
    from torchft import Manager

__all__ = [
    "SettingsAgreement",
    "SettingsMismatch",
    "lighthouse_address",
    "lighthouse_status",
    "wait_quorum",
]

logger = logging.getLogger(__name__)

_STATUS_TIMEOUT_S = 2.0
"""How long a message waits for the lighthouse's status page (only when a quorum is late)."""
_WAITS_FOR = re.compile(r"only have (\d+) participants, need min_replicas (\d+)")


def lighthouse_address(address: str | None) -> str | None:
    """The lighthouse's address: `address`, else `TORCHFT_LIGHTHOUSE` (as torchft reads it)."""
    return address or os.environ.get("TORCHFT_LIGHTHOUSE") or None


def lighthouse_status(address: str | None, timeout: float = _STATUS_TIMEOUT_S) -> str | None:
    """What the torchft lighthouse at `address` (None: `TORCHFT_LIGHTHOUSE`) says of its
    next quorum, e.g. "New quorum not ready, only have 1 participants, need min_replicas 2
    [...]" (its `/status` page); None where nothing answers within `timeout` seconds.

    A message about a missing quorum quotes it, so that it names the cause seen (a
    lighthouse waiting for `min_replicas` groups is up, not gone).
    """
    address = lighthouse_address(address)
    if address is None:
        return None
    url = address.rstrip("/") + "/status"
    if "://" not in url:
        url = "http://" + url
    # (no proxy: torchft's own connections to the lighthouse take none)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            page = response.read(1 << 16).decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException):
        return None
    found = re.search(r"Next quorum status:\s*([^<\n]+)", page)
    if found is None:
        return "no quorum status on its /status page (is it a torchft lighthouse?)"
    return html.unescape(found.group(1)).strip()


def _lighthouse_says(address: str | None) -> str:
    """Why a quorum is missing, as the lighthouse at `address` reports it (or that it does
    not answer), with what to do: the clause a warning or `GateLost` ends with."""
    where = lighthouse_address(address) or "(address unknown)"
    status = lighthouse_status(address)
    if status is None:
        return f"the lighthouse at {where} does not answer: it is gone or unreachable"
    waits = _WAITS_FOR.search(status)
    if waits is None:
        return f'the lighthouse at {where} is up and says: "{status}"'
    joined, need = int(waits.group(1)), int(waits.group(2))
    return (
        f"the lighthouse at {where} is up and waits for min_replicas {need} replica groups, "
        f'{joined} joined (it says: "{status}"); start another replica group, or restart '
        f"the lighthouse with --min_replicas {max(joined, 1)}"
    )


def wait_quorum(manager: Manager, start: bool = False, lighthouse: str | None = None) -> None:
    """Wait for `manager`'s quorum (`start`: start it too, for a synchronous-quorum manager).

    Warns once after the connect timeout and keeps waiting (a lighthouse may restart); the
    warning and the error quote the lighthouse at `lighthouse` (None: `TORCHFT_LIGHTHOUSE`).

    Raises:
        GateLost: no quorum within torchft's timeout; nothing of the step changed yet.
    """
    connect = getattr(manager, "_connect_timeout", None)
    quorum = getattr(manager, "_quorum_timeout", None)

    def warn() -> None:
        logger.warning(
            "torchft: no quorum of replica groups after %g s; %s; waiting up to the quorum "
            "timeout%s",
            connect.total_seconds(),
            _lighthouse_says(lighthouse),
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
        # torchft's own text is a gRPC status dump; its type and the lighthouse say enough.
        raise GateLost(
            f"torchft found no quorum of replica groups{within} ({type(e).__name__}): "
            f"{_lighthouse_says(lighthouse)}"
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
        waits = _WAITS_FOR.search(status)
        need = int(waits.group(2)) if waits is not None else 0
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
