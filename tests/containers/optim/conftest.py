"""Fixtures the CPU kernel's tests share."""

from __future__ import annotations

import os
import shutil

import pytest

from containers.optim import cpu_adam


@pytest.fixture
def lib() -> cpu_adam.Library:
    """The built and self-checked CPU kernel; skipped where there is no C compiler (the
    containers take torch's path there: tested in test_cpu_adam.py)."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: the containers take torch's path")
    found = cpu_adam.library()
    assert found is not None, "a C compiler is here: the kernel must build and pass its check"
    return found
