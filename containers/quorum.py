"""Waiting for a torchft quorum, quoting the lighthouse's `/status` when none comes."""

from __future__ import annotations

import concurrent.futures
import html
import http.client
import logging
import os
import re
import threading
import urllib.request
from typing import TYPE_CHECKING

from containers.parts import GateLost

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["lighthouse_address", "lighthouse_status", "min_replicas_wait", "wait_quorum"]

logger = logging.getLogger(__name__)

_STATUS_TIMEOUT_S = 2.0  # how long a message waits for the lighthouse's status page
_WAITS_FOR = re.compile(r"only have (\d+) participants, need min_replicas (\d+)")


def lighthouse_address(address: str | None) -> str | None:
    return address or os.environ.get("TORCHFT_LIGHTHOUSE") or None


def lighthouse_status(address: str | None, timeout: float = _STATUS_TIMEOUT_S) -> str | None:
    """What the lighthouse's `/status` page says of its next quorum (e.g. "New quorum not
    ready, only have 1 participants, need min_replicas 2 [...]"); None if nothing answers."""
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


def min_replicas_wait(status: str) -> tuple[int, int] | None:
    """(groups joined, `min_replicas`) where the lighthouse's `status` says it waits for more."""
    waits = _WAITS_FOR.search(status)
    return None if waits is None else (int(waits.group(1)), int(waits.group(2)))


def _lighthouse_says(address: str | None) -> str:
    """Why a quorum is missing, as the lighthouse reports it, with what to do."""
    where = lighthouse_address(address) or "(address unknown)"
    status = lighthouse_status(address)
    if status is None:
        return f"the lighthouse at {where} does not answer: it is gone or unreachable"
    waits = min_replicas_wait(status)
    if waits is None:
        return f'the lighthouse at {where} is up and says: "{status}"'
    joined, need = waits
    return (
        f"the lighthouse at {where} is up and waits for min_replicas {need} replica groups, "
        f'{joined} joined (it says: "{status}"); start another replica group, or restart '
        f"the lighthouse with --min_replicas {max(joined, 1)}"
    )


def wait_quorum(manager: Manager, start: bool = False, lighthouse: str | None = None) -> None:
    """Wait for `manager`'s quorum, warning once; `GateLost` past the quorum timeout."""
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
