"""Fixtures for lab tests: fake runners for the planner/executor, and a real lab for root-only tests."""
from __future__ import annotations

from typing import Iterator, Sequence

import pytest

from torch_thunderbolt.lab.executor import CommandResult
from torch_thunderbolt.testing.lab import lab_session, skip_unless_lab


class FakeRunner:
    """Records commands; `ip netns list` answers from `namespaces`, which add/del keep up to date."""

    def __init__(self, namespaces: Sequence[str] = (), fail_on: str | None = None) -> None:
        self.namespaces = list(namespaces)
        self.calls: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail_on and self.fail_on in " ".join(argv):
            return CommandResult(2, "", "RTNETLINK answers: File exists\n")
        if argv[:3] == ["ip", "netns", "list"]:
            return CommandResult(0, "".join(f"{n} (id: {i})\n" for i, n in enumerate(self.namespaces)))
        if argv[:3] == ["ip", "netns", "add"]:
            self.namespaces.append(argv[3])
        if argv[:3] == ["ip", "netns", "del"]:
            self.namespaces.remove(argv[3])
        return CommandResult(0)


@pytest.fixture
def fake_runner() -> FakeRunner:
    return FakeRunner()


@pytest.fixture
def make_runner() -> type[FakeRunner]:
    return FakeRunner


@pytest.fixture
def chain3_lab() -> Iterator:
    """A real 3-host chain at 10gbit (needs root); removed after the test whatever happens."""
    skip_unless_lab()
    with lab_session(3, "chain", rate="10gbit", cc="reno") as lab:
        yield lab
