"""A Mac kept awake while a group exists: one IOKit power assertion per process, held by its groups.

An idle Mac goes to sleep (System Settings › Energy / Battery, or `pmset -g`'s `sleep` minutes), and XNU
drops the TCP connections whose retransmissions went unanswered across the sleep: a job dies at its next
collective, or hangs until the timeout when the sleeping Mac was the one to answer. So the world group takes
a `PreventUserIdleSystemSleep` assertion (IOKit's `IOPMAssertionCreateWithName`, what `caffeinate -i` takes)
when it is created, before its set-up waits for the other ranks, and every group split or shrunk from it
shares it; the last of them to be destroyed releases it (`IOPMAssertionRelease`), as does a set-up that
fails. The assertion keeps the system from sleeping when idle; the display may still sleep. It does not
stop the sleep a closed lid causes (unless the laptop is on power with an external display), nor a
battery running low; `doctor` says how a Mac is set (`power_advice`). The assertion shows in
`pmset -g assertions` under the process's name with the reason below.

THUNDERBOLT_KEEP_AWAKE=0 turns it off. Elsewhere than macOS nothing is taken.
"""
from __future__ import annotations

import ctypes
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..platform import Platform, current

log = logging.getLogger("torch_thunderbolt")

IOKIT = "/System/Library/Frameworks/IOKit.framework/IOKit"
CORE_FOUNDATION = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"
PREVENT_IDLE_SLEEP = "PreventUserIdleSystemSleep"  # kIOPMAssertionTypePreventUserIdleSystemSleep (IOPMLib.h)
ASSERTION_LEVEL_ON = 255  # kIOPMAssertionLevelOn
CF_STRING_ENCODING_UTF8 = 0x08000100  # kCFStringEncodingUTF8
REASON = "torch-thunderbolt: a process group is running"

Libraries = Callable[[], "tuple[Any, Any] | None"]


def _system_libraries() -> tuple[Any, Any] | None:
    """(IOKit, CoreFoundation) with the four functions typed, or None where they cannot be loaded."""
    try:
        iokit, cf = ctypes.CDLL(IOKIT), ctypes.CDLL(CORE_FOUNDATION)
    except OSError:
        return None
    cf.CFStringCreateWithCString.restype = ctypes.c_void_p
    cf.CFStringCreateWithCString.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
    cf.CFRelease.restype, cf.CFRelease.argtypes = None, [ctypes.c_void_p]
    iokit.IOPMAssertionCreateWithName.restype = ctypes.c_int32  # IOReturn
    iokit.IOPMAssertionCreateWithName.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                                                  ctypes.POINTER(ctypes.c_uint32)]
    iokit.IOPMAssertionRelease.restype, iokit.IOPMAssertionRelease.argtypes = ctypes.c_int32, [ctypes.c_uint32]
    return iokit, cf


class KeepAwake:
    """The power assertion of a process's groups: taken by the first `hold`, released when the last hold
    is dropped. Where there is none to take (not macOS, turned off, IOKit refused) holds cost nothing."""

    def __init__(self, enabled: bool = True, plat: Platform | None = None,
                 libraries: Libraries | None = None) -> None:
        plat = plat or current()
        self._wanted = enabled and plat.name == "darwin"
        self._libraries = libraries or _system_libraries  # (a test's model of IOKit, else the system's)
        self._lock = threading.Lock()
        self._holds = 0
        self._assertion: int | None = None
        self._iokit: Any = None

    @property
    def held(self) -> bool:
        """Whether the assertion is taken now."""
        return self._assertion is not None

    def hold(self) -> "Hold":
        """One more holder: the first takes the assertion."""
        with self._lock:
            self._holds += 1
            if self._holds == 1 and self._wanted:
                self._assertion = self._create()
        return Hold(self)

    def _drop(self) -> None:
        with self._lock:
            self._holds -= 1
            if self._holds == 0 and self._assertion is not None:
                err = self._iokit.IOPMAssertionRelease(self._assertion)
                if err:
                    log.debug("IOPMAssertionRelease(%d) returned %#x", self._assertion, err & 0xFFFFFFFF)
                self._assertion = None

    def _create(self) -> int | None:
        libs = self._libraries()
        if libs is None:
            log.warning("cannot keep this Mac awake while the job runs: IOKit could not be loaded; "
                        "run it under `caffeinate -i` instead (or set THUNDERBOLT_KEEP_AWAKE=0 to silence this)")
            return None
        iokit, cf = libs
        kind = cf.CFStringCreateWithCString(None, PREVENT_IDLE_SLEEP.encode(), CF_STRING_ENCODING_UTF8)
        name = cf.CFStringCreateWithCString(None, REASON.encode(), CF_STRING_ENCODING_UTF8)
        try:
            assertion = ctypes.c_uint32(0)
            err = iokit.IOPMAssertionCreateWithName(kind, ASSERTION_LEVEL_ON, name, ctypes.pointer(assertion))
        finally:
            for s in (kind, name):
                if s:
                    cf.CFRelease(s)
        if err:
            log.warning("cannot keep this Mac awake while the job runs: IOPMAssertionCreateWithName returned "
                        "%#x; run it under `caffeinate -i` instead", err & 0xFFFFFFFF)
            return None
        self._iokit = iokit
        return assertion.value


class Hold:
    """One holder's share of the assertion; `release` drops it (once: later calls do nothing)."""

    def __init__(self, owner: KeepAwake) -> None:
        self._owner: KeepAwake | None = owner
        self._lock = threading.Lock()

    @property
    def owner(self) -> KeepAwake | None:
        """The assertion this holds a share of (None once released)."""
        return self._owner

    def release(self) -> None:
        with self._lock:
            owner, self._owner = self._owner, None
        if owner is not None:
            owner._drop()


@dataclass(frozen=True)
class PowerState:
    """A Mac's power source and sleep settings, as `pmset -g batt` and `pmset -g` print them."""

    source: str = ""  # "AC Power", "Battery Power", "UPS Power"; "" when pmset said nothing readable
    battery: bool = False  # an internal battery (a laptop): its lid can close
    percent: int | None = None  # its charge
    sleep_minutes: int | None = None  # idle minutes before system sleep in use (0: never); None: unknown
    sleep_disabled: bool = False  # `pmset disablesleep 1`: no system sleep at all, a closed lid's included


_SOURCE = re.compile(r"Now drawing from '([^']+)'")
_BATTERY = re.compile(r"InternalBattery\S*\s+\(id=\d+\)\s+(\d{1,3})%")
_SLEEP = re.compile(r"^\s*sleep\s+(\d+)", re.MULTILINE)  # (displaysleep and disksleep are other lines)
_SLEEP_DISABLED = re.compile(r"^\s*SleepDisabled\s+(\d)", re.MULTILINE)


def parse_power(batt: str, settings: str) -> PowerState:
    """The PowerState of `pmset -g batt`'s output and `pmset -g`'s (either may be "": unknown)."""
    source = _SOURCE.search(batt)
    battery = _BATTERY.search(batt)
    sleep = _SLEEP.search(settings)
    disabled = _SLEEP_DISABLED.search(settings)
    return PowerState(source=source.group(1) if source else "", battery=battery is not None,
                      percent=int(battery.group(1)) if battery else None,
                      sleep_minutes=int(sleep.group(1)) if sleep else None,
                      sleep_disabled=bool(disabled and disabled.group(1) == "1"))


def power_advice(state: PowerState, keep_awake: bool) -> tuple[bool, str, str]:
    """(fine, what the state means for a job, what to do when not fine)."""
    if not state.source and state.sleep_minutes is None:
        return False, "pmset printed nothing readable: whether this Mac sleeps during a job is unknown", \
            "check System Settings › Battery (or Energy) › Options, or run `pmset -g`"
    charge = f" ({state.percent}%)" if state.percent is not None else ""
    source = {"AC Power": "on power", "Battery Power": "on battery", "UPS Power": "on a UPS"}.get(
        state.source, f"on {state.source or 'an unknown power source'}")
    where = source + (charge if state.source == "Battery Power" else f", a laptop{charge}" if state.battery else "")
    if state.sleep_disabled:
        return True, f"{where}; sleep is disabled (pmset disablesleep 1): it stays awake, closed lid included", ""
    idle = ("never sleeps when idle" if state.sleep_minutes == 0 else
            f"sleeps after {state.sleep_minutes} idle minute{'s' if state.sleep_minutes > 1 else ''}"
            if state.sleep_minutes else "idle sleep unknown")
    if not keep_awake and state.sleep_minutes != 0:
        return False, f"{where}; {idle}, and THUNDERBOLT_KEEP_AWAKE=0 takes no power assertion: a job that " \
            "outlasts that is cut off when the Mac sleeps", \
            "unset THUNDERBOLT_KEEP_AWAKE, or run the ranks under `caffeinate -i`"
    held = "; a group's power assertion holds off idle sleep" if state.sleep_minutes != 0 else ""
    if state.source == "Battery Power":
        return False, f"{where}; {idle}{held}, but not the sleep a closed lid or a low battery causes, and a " \
            "Mac that sleeps is lost to its peers", "keep it on power, with the lid open"
    lid = ", but closing the lid still sleeps it unless an external display is connected" if state.battery else ""
    return True, f"{where}; {idle}{held}{lid}", ""
