"""containers/optim/c_library: a C source built into a private cache, loaded, or refused."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from containers.optim import c_library

FLAGS = ("-O1",)


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A small C source, and a private cache directory of the test's own."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("OPTIMIZER_CONTAINERS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "answer.c"
    path.write_text("int answer(void) { return A_FLAG + 41; }\n")
    return path


def _bind(lib: ctypes.CDLL) -> None:
    lib.answer.restype = ctypes.c_int


def _answer(source) -> int:
    return c_library.open_library(source, FLAGS, _bind).answer()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_cached_library_that_does_not_load_is_built_again(source, monkeypatch, caplog):
    monkeypatch.setenv("CC", f"{shutil.which('cc')} -DA_FLAG=1")
    target = c_library.cached([shutil.which("cc"), "-DA_FLAG=1"], source, FLAGS)
    target.write_bytes(b"not a shared object")  # as a crash during a copy might leave it
    target.chmod(0o700)
    assert _answer(source) == 42
    assert "did not load" in _warnings(caplog)[0]
    assert target.read_bytes()[:4] == b"\x7fELF"


def test_a_cached_library_others_may_write_is_replaced(source, monkeypatch):
    monkeypatch.setenv("CC", "cc -DA_FLAG=1")
    target = c_library.cached(["cc", "-DA_FLAG=1"], source, FLAGS)
    target.write_bytes(b"planted")
    target.chmod(0o777)
    assert _answer(source) == 42
    assert target.read_bytes()[:4] == b"\x7fELF" and target.stat().st_mode & 0o777 == 0o700


def test_a_cache_others_may_write_is_refused(source, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "cc -DA_FLAG=1")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("OPTIMIZER_CONTAINERS_CACHE", str(shared))
    with pytest.raises(OSError, match=r"writable by no one else.*OPTIMIZER_CONTAINERS_CACHE"):
        _answer(source)
    assert not list(shared.iterdir())
    # a new directory is made private to its user
    monkeypatch.setenv("OPTIMIZER_CONTAINERS_CACHE", str(tmp_path / "new"))
    assert _answer(source) == 42
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700


def test_a_compiler_with_arguments_is_split_as_a_shell_would(source, monkeypatch):
    monkeypatch.setenv("CC", f"{shutil.which('cc')} -DA_FLAG=1")
    assert _answer(source) == 42


def test_a_failed_build_raises_what_the_compiler_said(source, monkeypatch):
    monkeypatch.setenv("CC", "cc")  # A_FLAG undefined: the source does not compile
    with pytest.raises(OSError, match="A_FLAG"):
        _answer(source)
    assert not list(source.parent.rglob("*.so*"))


def test_a_library_bind_refuses_is_built_again_once_then_raises(source, monkeypatch, caplog):
    monkeypatch.setenv("CC", "cc -DA_FLAG=1")

    def refuse(lib: ctypes.CDLL) -> None:
        lib.no_such_function  # noqa: B018  (an AttributeError, as a stale library gives)

    with pytest.raises(AttributeError, match="no_such_function"):
        c_library.open_library(source, FLAGS, refuse)
    assert len(_warnings(caplog)) == 1  # one rebuild, then the error
