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


# `pmset -g batt` and `pmset -g` as Macs print them (public transcripts, bug reports and other projects'
# fixtures): a laptop on battery, a laptop on power, a desktop (no battery line); the live settings of a
# macOS 12 laptop, of an Apple-silicon Mac, the same with `sleep` set to 0 (the one value changed here),
# one whose values are tab-separated, and one with `pmset disablesleep 1`.
BATT_ON_BATTERY = ("Now drawing from 'Battery Power'\n"
                   " -InternalBattery-0 (id=22806627)\t78%; discharging; 5:05 remaining present: true\n")
BATT_LAPTOP_ON_POWER = ("Now drawing from 'AC Power'\n"
                        " -InternalBattery-0 (id=22806627)\t100%; charged; 0:00 remaining present: true\n")
BATT_DESKTOP = "Now drawing from 'AC Power'\n"
PMSET_LAPTOP = """System-wide power settings:
Currently in use:
 lidwake              1
 autopoweroff         1
 standbydelayhigh     86400
 autopoweroffdelay    28800
 standbydelaylow      10800
 standby              1
 proximitywake        0
 ttyskeepawake        1
 hibernatemode        3
 gpuswitch            2
 powernap             1
 hibernatefile        /var/vm/sleepimage
 highstandbythreshold 50
 displaysleep         28
 sleep                1 (sleep prevented by sharingd)
 acwake               0
 halfdim              1
 tcpkeepalive         1
 disksleep            0
"""
PMSET_APPLE_SILICON = """System-wide power settings:
Currently in use:
 standby              1
 Sleep On Power Button 1
 hibernatefile        /var/vm/sleepimage
 powernap             1
 networkoversleep     0
 disksleep            10
 sleep                1 (sleep prevented by screensharingd)
 hibernatemode        3
 ttyskeepawake        1
 displaysleep         10
 tcpkeepalive         1
 lowpowermode         0
 womp                 0
"""
PMSET_NEVER = PMSET_APPLE_SILICON.replace(" sleep                1 (sleep prevented by screensharingd)",
                                          " sleep                0")
PMSET_TABS = ("System-wide power settings:\nCurrently in use:\n standby              1\n"
              " disksleep            10\n sleep                1 (sleep prevented by coreaudiod)\n"
              " displaysleep         10\n SleepDisabled\t\t0\n tcpkeepalive         1\n")
PMSET_SLEEP_DISABLED = ("System-wide power settings:\n SleepDisabled\t\t1\nCurrently in use:\n standby              1\n"
                        " Sleep On Power Button 1\n"
                        " sleep                0 (sleep prevented by coreaudiod, coreaudiod, bluetoothd, caffeinate)\n"
                        " displaysleep         0\n")


def test_pmset_outputs_parse() -> None:
    from torch_thunderbolt.backend.keep_awake import PowerState, parse_power

    assert parse_power(BATT_ON_BATTERY, PMSET_LAPTOP) == PowerState("Battery Power", True, 78, 1, False)
    assert parse_power(BATT_LAPTOP_ON_POWER, PMSET_LAPTOP) == PowerState("AC Power", True, 100, 1, False)
    assert parse_power(BATT_DESKTOP, PMSET_NEVER) == PowerState("AC Power", False, None, 0, False)
    assert parse_power(BATT_DESKTOP, PMSET_APPLE_SILICON).sleep_minutes == 1  # not displaysleep's or disksleep's 10
    assert parse_power(BATT_DESKTOP, PMSET_TABS) == PowerState("AC Power", False, None, 1, False)
    assert parse_power(BATT_DESKTOP, PMSET_SLEEP_DISABLED).sleep_disabled
    assert parse_power("", "") == PowerState()  # pmset failed: nothing known


def _doctor_sleep(batt: str, settings: str, env: dict[str, str] | None = None):
    from torch_thunderbolt.doctor import Facts, run_checks

    facts = Facts(system="Darwin", python="3.12", torch="2.13.0", backend_registered=True, env=env or {},
                  interfaces={"lo0": ["127.0.0.1"]}, thunderbolt_ifnames=[], pmset=(batt, settings))
    found = [x for x in run_checks(facts) if x.check == "sleep"]
    assert len(found) == 1
    return found[0]


def test_doctor_says_what_sleep_means_for_a_job() -> None:
    on_battery = _doctor_sleep(BATT_ON_BATTERY, PMSET_LAPTOP)
    assert on_battery.status == "warn" and "78%" in on_battery.detail and "closed lid" in on_battery.detail
    assert "on power" in on_battery.fix
    laptop = _doctor_sleep(BATT_LAPTOP_ON_POWER, PMSET_LAPTOP)
    assert laptop.status == "ok" and "lid" in laptop.detail and "power assertion holds off idle sleep" in laptop.detail
    desktop = _doctor_sleep(BATT_DESKTOP, PMSET_NEVER)
    assert desktop.status == "ok" and "never sleeps" in desktop.detail and "lid" not in desktop.detail
    assert "closed lid included" in _doctor_sleep(BATT_ON_BATTERY, PMSET_SLEEP_DISABLED).detail
    off = _doctor_sleep(BATT_LAPTOP_ON_POWER, PMSET_LAPTOP, {"THUNDERBOLT_KEEP_AWAKE": "0"})
    assert off.status == "warn" and "caffeinate -i" in off.fix
    assert _doctor_sleep("", "").status == "warn"


def test_doctor_reads_pmset_by_path_on_a_mac_only() -> None:
    from torch_thunderbolt.doctor import _macos_pmset
    from torch_thunderbolt.platform import PMSET

    outputs = {(PMSET, "-g", "batt"): BATT_ON_BATTERY, (PMSET, "-g"): PMSET_LAPTOP}
    run = lambda argv: SimpleNamespace(stdout=outputs[tuple(argv)], returncode=0)  # noqa: E731
    assert _macos_pmset(run, DARWIN) == (BATT_ON_BATTERY, PMSET_LAPTOP)
    assert _macos_pmset(lambda argv: pytest.fail("no pmset on Linux"), Platform.for_system("linux")) is None
