"""A Mac kept awake while a group exists (backend/keep_awake.py), with IOKit modelled by
torch_thunderbolt.testing.darwin_runtime.FakeIOKit under the darwin platform."""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from torch_thunderbolt.backend import keep_awake
from torch_thunderbolt.backend.keep_awake import ASSERTION_LEVEL_ON, PREVENT_IDLE_SLEEP, KeepAwake
from torch_thunderbolt.platform import Platform
from torch_thunderbolt.testing.darwin_runtime import FakeIOKit

DARWIN = Platform.for_system("darwin")


def creates(iokit: FakeIOKit) -> list[tuple]:
    return [c for c in iokit.calls if c[0] == "create"]


def test_the_first_hold_takes_the_assertion_and_the_last_release_drops_it() -> None:
    iokit = FakeIOKit()
    awake = KeepAwake(True, DARWIN, iokit.libraries)
    first, second = awake.hold(), awake.hold()
    assert len(iokit.live) == 1 and awake.held
    (kind, level, _name), = iokit.live.values()
    assert kind == PREVENT_IDLE_SLEEP and level == ASSERTION_LEVEL_ON
    first.release()
    first.release()  # twice: still one share
    assert len(iokit.live) == 1
    second.release()
    assert not iokit.live and not awake.held and not iokit.strings  # every CFString released too
    assert len(creates(iokit)) == 1 and [c[0] for c in iokit.calls] == ["create", "release"]


def test_nothing_is_taken_when_off_or_off_macos() -> None:
    def no_iokit() -> None:
        pytest.fail("IOKit loaded where no assertion is wanted")

    for awake in (KeepAwake(False, DARWIN, no_iokit), KeepAwake(True, Platform.for_system("linux"), no_iokit)):
        awake.hold().release()
        assert not awake.held


def test_a_refused_assertion_is_a_warning_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    iokit = FakeIOKit(create_error=-536870201)  # kIOReturnNotPrivileged
    awake = KeepAwake(True, DARWIN, iokit.libraries)
    hold = awake.hold()
    assert not awake.held and "caffeinate -i" in caplog.text and not iokit.strings
    hold.release()
    assert [c[0] for c in iokit.calls] == ["create"]


@pytest.fixture
def mac(monkeypatch: pytest.MonkeyPatch) -> FakeIOKit:
    """This process as a Mac's, as far as the power assertion goes."""
    iokit = FakeIOKit()
    monkeypatch.setattr(keep_awake, "current", lambda: DARWIN)
    monkeypatch.setattr(keep_awake, "_system_libraries", iokit.libraries)
    monkeypatch.delenv("THUNDERBOLT_KEEP_AWAKE", raising=False)
    return iokit


def test_a_group_keeps_the_mac_awake_from_init_to_destroy(mac: FakeIOKit) -> None:
    import torch_thunderbolt  # noqa: F401 - registers the backend

    dist.init_process_group("thunderbolt", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        assert len(mac.live) == 1
        sub = dist.new_group([0])
        x = torch.ones(2)
        dist.all_reduce(x, group=sub)
        assert len(creates(mac)) == 1 and len(mac.live) == 1  # one assertion for the process, shared
    finally:
        dist.destroy_process_group()
    assert not mac.live and not mac.strings


def test_keep_awake_0_takes_nothing(mac: FakeIOKit, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_thunderbolt  # noqa: F401

    monkeypatch.setenv("THUNDERBOLT_KEEP_AWAKE", "0")
    dist.init_process_group("thunderbolt", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    dist.destroy_process_group()
    assert not mac.calls


def test_a_set_up_that_fails_releases_the_assertion(mac: FakeIOKit, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_thunderbolt.backend.registration import create_process_group
    from torch_thunderbolt.rendezvous import group

    def refused(*args: object, **kwargs: object) -> None:
        assert len(mac.live) == 1  # held while the set-up waits for the other ranks
        raise ConnectionError("rank 0: peer 1 never connected")

    monkeypatch.setattr(group, "connect", refused)
    opts = SimpleNamespace(group_rank=0, group_size=2, timeout=timedelta(seconds=5), store=dist.HashStore(),
                           group_id="0")
    with pytest.raises(ConnectionError):
        create_process_group(opts)
    assert not mac.live and [c[0] for c in mac.calls] == ["create", "release"]
