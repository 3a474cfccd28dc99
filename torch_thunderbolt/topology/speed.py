"""Link speed strings as the OS prints them, turned into Gbit/s."""
from __future__ import annotations

import re

from ..errors import ConfigError

_SPEED = re.compile(r"(\d+(?:\.\d+)?)\s*([GM])(?:b/s|bit/s|bps|bits/s)\b", re.IGNORECASE)


def link_speed_gbps(text: str) -> float:
    """Gbit/s from "Up to 40 Gb/s", "Up to 80 Gb/s", "120 Gb/s", "20.0 Gb/s", "10000 Mb/s".

    Empty text means the OS did not say (a port with nothing connected): 0.0.
    Anything else that carries no speed is an error, so a format change is noticed, not ignored.
    """
    text = (text or "").strip()
    if not text:
        return 0.0
    match = _SPEED.search(text)
    if match is None:
        raise ConfigError(f"cannot read a link speed from {text!r} (expected e.g. 'Up to 40 Gb/s')")
    value = float(match.group(1))
    return value / 1000.0 if match.group(2).upper() == "M" else value


def generation(speed_gbps: float) -> str:
    """A human label for a link rate; rates are what each Thunderbolt generation negotiates."""
    if speed_gbps <= 0:
        return "?"
    if speed_gbps > 40:
        return "TB5"
    if speed_gbps >= 40:
        return "TB4/TB3"
    return "slow"
