"""Parsing of sizes ("4K", "1M", nccl-tests' -b/-e/-f) and comma lists. Pure; no torch import."""
from __future__ import annotations

import re
from typing import Sequence

from ..errors import ConfigError

# nccl-tests and most users mean binary multiples: 4K = 4096 bytes.
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)

MAX_SIZES = 256  # a -b/-e/-f range longer than this is a typo, not a benchmark


def parse_size(text: str) -> int:
    """'4K' -> 4096, '1M' -> 1048576, '1.5K' -> 1536, '512' / '512B' / '4KiB' also accepted."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"bad size {text!r}: expected a byte count like 4096, 4K, 64K, 1M, 256M or 1G")
    number, unit = match.groups()
    value = float(number) * _UNITS[unit.upper()]
    if value != int(value) or value <= 0:
        raise ConfigError(f"bad size {text!r}: expected a positive whole number of bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    """Inverse of parse_size for exact multiples (4096 -> '4K'); other values stay in bytes."""
    for unit in ("T", "G", "M", "K"):
        scale = _UNITS[unit]
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def size_range(begin: int, end: int, factor: float) -> list[int]:
    """nccl-tests' -b/-e/-f: begin, begin*f, begin*f^2, ... up to and including end."""
    if begin <= 0 or end < begin:
        raise ConfigError(f"bad size range -b {begin} -e {end}: expected 0 < begin <= end")
    if factor <= 1:
        if begin == end:
            return [begin]
        raise ConfigError(f"bad step factor -f {factor}: expected a number > 1")
    sizes: list[int] = []
    size = float(begin)
    while size <= end * (1 + 1e-9):
        value = int(round(size))
        if not sizes or value != sizes[-1]:
            sizes.append(value)
        if len(sizes) > MAX_SIZES:
            raise ConfigError(f"size range -b {begin} -e {end} -f {factor} has more than {MAX_SIZES} sizes")
        size *= factor
    return sizes


def parse_sizes(text: str) -> list[int]:
    """'4K,64K,1M' -> [4096, 65536, 1048576], sorted and without duplicates."""
    items = split_list(text, "sizes")
    return sorted({parse_size(item) for item in items})


def split_list(text: str, what: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; an empty list is an error naming `what`."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigError(f"empty --{what}: expected a comma-separated list")
    return items


def parse_int_list(text: str, what: str, minimum: int = 1) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, unique); each at least `minimum`."""
    values = []
    for item in split_list(text, what):
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"bad --{what} entry {item!r}: expected a whole number") from None
        if value < minimum:
            raise ConfigError(f"bad --{what} entry {item!r}: expected at least {minimum}")
        values.append(value)
    return sorted(set(values))


def choose(items: Sequence[str], known: Sequence[str], what: str, aliases: dict[str, str] | None = None) -> list[str]:
    """Validate names against `known` ('all' expands to all of them), keeping the user's order."""
    aliases = aliases or {}
    chosen: list[str] = []
    for item in items:
        name = aliases.get(item.lower(), item.lower())
        names = list(known) if name == "all" else [name]
        for one in names:
            if one not in known:
                raise ConfigError(f"unknown {what} {item!r}: expected one of {', '.join(known)} or all")
            if one not in chosen:
                chosen.append(one)
    return chosen
