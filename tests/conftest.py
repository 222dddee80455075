"""The `slow` marker: `pytest -m "not slow"` is a developer's quick loop; the README's command
(and `.ci/run`) runs every test. A quick run says in one line how many slow tests it left out."""

from __future__ import annotations

import pytest

_left_out: list[pytest.Item] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: a test of many seconds (torchft jobs, signals, inductor compiles)"
    )


def pytest_deselected(items: list[pytest.Item]) -> None:
    _left_out.extend(item for item in items if item.get_closest_marker("slow"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _left_out and "slow" in terminalreporter.config.getoption("markexpr"):
        terminalreporter.write_line(
            f"left out {len(_left_out)} slow tests (marked slow); the README's test command "
            "runs them too"
        )
