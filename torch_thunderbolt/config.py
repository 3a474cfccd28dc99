"""Configuration from environment variables, parsed by one pure function.

Every knob is documented in the README's configuration table; bad values raise ConfigError naming the
variable and what was expected.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from .errors import ConfigError

ALGOS = ("auto", "ring", "biring", "direct", "chain")
TRANSPORTS = ("auto", "tcp", "shm")
COMPRESSIONS = ("none", "int8", "fp16", "bf16")


def parse_size(text: str, name: str = "size") -> int:
    """'4K' / '1M' / '2G' / '4096' -> bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if mult != 1 else t
    try:
        value = int(float(digits) * mult)
    except ValueError:
        raise ConfigError(f"{name}: expected a size like 4096, 64K, 1M or 2G, got {text!r}") from None
    if value < 0:
        raise ConfigError(f"{name}: must not be negative, got {text!r}")
    return value


@dataclass(frozen=True)
class Config:
    ifnames: tuple[str, ...] = ()  # THUNDERBOLT_IFNAME: interfaces (or addresses) to use
    streams: int = 2  # THUNDERBOLT_STREAMS: TCP connections per peer
    transport: str = "auto"  # THUNDERBOLT_TRANSPORT
    algo: str = "auto"  # THUNDERBOLT_ALGO
    chunk_bytes: int = 1 << 20  # THUNDERBOLT_CHUNK: pipeline piece size
    small_bytes: int = 64 << 10  # THUNDERBOLT_SMALL: up to here, latency-optimal algorithms
    stripe_bytes: int = 256 << 10  # THUNDERBOLT_STRIPE: messages from here on are split over streams
    socket_buffer: int = 4 << 20  # THUNDERBOLT_SOCKET_BUFFER: SO_SNDBUF / SO_RCVBUF
    listen_all: bool = False  # THUNDERBOLT_LISTEN_ALL=1: listen on 0.0.0.0 instead of the chosen address
    port: int = 0  # THUNDERBOLT_PORT: first listening port (0 = any free one)
    connect_timeout: float = 120.0  # THUNDERBOLT_CONNECT_TIMEOUT seconds
    compression: str = "none"  # THUNDERBOLT_COMPRESSION (lossy, float all_reduce only)
    compression_block: int = 256  # THUNDERBOLT_COMPRESSION_BLOCK: int8 values per scale
    congestion_control: str = ""  # THUNDERBOLT_CC: per-socket TCP congestion control (Linux), e.g. cubic
    spin_us: int = 200  # THUNDERBOLT_SPIN_US: busy-poll this long before sleeping (0 = never); a 2-rank
    # ping-pong over loopback TCP waits ~70 µs per round trip, so a shorter spin ends in a wake-up each time
    link_timeout_ms: int = 3000  # THUNDERBOLT_LINK_TIMEOUT_MS: data unacknowledged this long = link lost
    debug: bool = False  # THUNDERBOLT_DEBUG=1: full per-op signature checks and verbose logs
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Config":
        env = os.environ if env is None else env
        get = lambda k: env.get(k, "").strip()  # noqa: E731
        kw: dict = {}
        if get("THUNDERBOLT_IFNAME"):
            kw["ifnames"] = tuple(x.strip() for x in get("THUNDERBOLT_IFNAME").split(",") if x.strip())
        if get("THUNDERBOLT_STREAMS"):
            kw["streams"] = _int(get("THUNDERBOLT_STREAMS"), "THUNDERBOLT_STREAMS", 1, 64)
        kw["transport"] = _choice(get("THUNDERBOLT_TRANSPORT") or "auto", "THUNDERBOLT_TRANSPORT", TRANSPORTS)
        kw["algo"] = _choice(get("THUNDERBOLT_ALGO") or "auto", "THUNDERBOLT_ALGO", ALGOS)
        kw["compression"] = _choice(get("THUNDERBOLT_COMPRESSION") or "none", "THUNDERBOLT_COMPRESSION",
                                    COMPRESSIONS)
        for var, key in (("THUNDERBOLT_CHUNK", "chunk_bytes"), ("THUNDERBOLT_SMALL", "small_bytes"),
                         ("THUNDERBOLT_STRIPE", "stripe_bytes"), ("THUNDERBOLT_SOCKET_BUFFER", "socket_buffer")):
            if get(var):
                kw[key] = parse_size(get(var), var)
        if kw.get("chunk_bytes", 1 << 20) < 1024:
            raise ConfigError("THUNDERBOLT_CHUNK: expected at least 1K")
        if get("THUNDERBOLT_COMPRESSION_BLOCK"):
            kw["compression_block"] = _int(get("THUNDERBOLT_COMPRESSION_BLOCK"), "THUNDERBOLT_COMPRESSION_BLOCK", 1,
                                           1 << 20)
        if get("THUNDERBOLT_SPIN_US"):
            kw["spin_us"] = _int(get("THUNDERBOLT_SPIN_US"), "THUNDERBOLT_SPIN_US", 0, 1_000_000)
        if get("THUNDERBOLT_LINK_TIMEOUT_MS"):
            kw["link_timeout_ms"] = _int(get("THUNDERBOLT_LINK_TIMEOUT_MS"), "THUNDERBOLT_LINK_TIMEOUT_MS", 500,
                                         600_000)
        if get("THUNDERBOLT_PORT"):
            kw["port"] = _int(get("THUNDERBOLT_PORT"), "THUNDERBOLT_PORT", 0, 65535)
        if get("THUNDERBOLT_CONNECT_TIMEOUT"):
            kw["connect_timeout"] = float(_int(get("THUNDERBOLT_CONNECT_TIMEOUT"), "THUNDERBOLT_CONNECT_TIMEOUT",
                                               1, 86400))
        kw["listen_all"] = _flag(get("THUNDERBOLT_LISTEN_ALL"), "THUNDERBOLT_LISTEN_ALL")
        kw["debug"] = _flag(get("THUNDERBOLT_DEBUG"), "THUNDERBOLT_DEBUG") or env.get(
            "TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        kw["congestion_control"] = get("THUNDERBOLT_CC")
        return cls(**kw)


def _int(text: str, name: str, lo: int, hi: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer from {lo} to {hi}, got {text!r}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name}: expected an integer from {lo} to {hi}, got {v}")
    return v


def _choice(text: str, name: str, allowed: tuple[str, ...]) -> str:
    if text.lower() not in allowed:
        raise ConfigError(f"{name}: expected one of {', '.join(allowed)}, got {text!r}")
    return text.lower()


def _flag(text: str, name: str) -> bool:
    if text.lower() in ("", "0", "false", "no", "off"):
        return False
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}: expected 0 or 1, got {text!r}")
