"""A C source built at run time into a private cache and loaded with ctypes (`open_library`).

What keeps a runtime-built library safe to load (each point tested in
`tests/containers/optim/test_c_library.py`):
- built with the system's C compiler (`$CC`, split as a shell would, else `cc`) for this CPU,
  cached by source, compiler, flags and CPU in a directory that must belong to this user and
  be writable by no one else (`$OPTIMIZER_CONTAINERS_CACHE`, else
  `~/.cache/optimizer-containers/kernels`, made private if new);
- written under a temporary name and renamed, so processes that build at once each see a
  whole file; a cached file another user may write is removed and built again, and one that
  does not load (or fails `bind`) is built again once.
Every failure raises (OSError, RuntimeError, ...): the caller falls back and says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["cached", "open_library"]

logger = logging.getLogger(__name__)


def open_library(
    source: Path, flags: Sequence[str], bind: Callable[[ctypes.CDLL], None]
) -> ctypes.CDLL:
    """The library of `source` built with `flags`, from the cache or built there, and
    `bind`'s checks passed (its functions' types set; raises OSError, RuntimeError or
    AttributeError if it is not the library the caller expects)."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    target = cached(cc, source, flags)
    if not _ours(target):
        _compile(cc, source, flags, target)
    try:
        return _dlopen(target, bind)
    except (OSError, AttributeError) as e:
        logger.warning("%s: cached %s did not load (%s); building it again", source.stem, target, e)
        target.unlink()
        _compile(cc, source, flags, target)
        return _dlopen(target, bind)


def cached(cc: list[str], source: Path, flags: Sequence[str]) -> Path:
    """Where the library of `source` built by `cc` with `flags` for this CPU is kept."""
    version = subprocess.run([*cc, "--version"], capture_output=True, check=True, timeout=60)
    key = hashlib.sha256(
        source.read_bytes() + version.stdout + shlex.join(cc + list(flags)).encode()
    )
    key.update((platform.machine() + _cpu_flags()).encode())
    return _cache() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _dlopen(target: Path, bind: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(target))
    bind(lib)
    return lib


def _cache() -> Path:
    """The cache directory, made private to this user if new; refused if another user owns
    it or others may write to it (a library planted there would run inside the trainer)."""
    given = os.environ.get("OPTIMIZER_CONTAINERS_CACHE")
    if given:
        path = Path(given)
    else:
        base = os.environ.get("XDG_CACHE_HOME")
        # (a directory of its own: the data cache shares the parent, made with any umask)
        path = (Path(base) if base else Path.home() / ".cache") / "optimizer-containers" / "kernels"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(
            f"cache {path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}: "
            f"it must be this user's ({os.getuid()}) and writable by no one else; set "
            "OPTIMIZER_CONTAINERS_CACHE to such a directory"
        )
    return path


def _ours(target: Path) -> bool:
    """Whether `target` exists as this user's file that no one else may write (else it is
    removed, to be built again)."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    if st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return True
    target.unlink()
    return False


def _compile(cc: list[str], source: Path, flags: Sequence[str], target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [*cc, *flags, "-fPIC", "-shared", str(source), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise OSError(f"`{shlex.join(cmd)}` failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("%s: built %s", source.stem, target)


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor()
