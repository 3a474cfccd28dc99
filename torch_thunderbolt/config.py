"""Configuration from environment variables, parsed by one pure function.

SETTINGS lists every variable the package reads, each marked for a user (what a few Macs cabled together
need) or advanced (tuning knobs, test and lab plumbing); docs/configuration.md documents each in that
table (tests/core/test_configuration_doc.py holds them together). Bad values raise ConfigError naming the
variable and what was expected.
"""
from __future__ import annotations

import math
import mmap
import os
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .errors import ConfigError
from .platform import Platform, current

ALGOS = ("auto", "ring", "biring", "direct", "chain")
TRANSPORTS = ("auto", "tcp", "shm", "rdma")
COMPRESSIONS = ("none", "int8", "fp16", "bf16")
INTEGRITY_MODES = ("none", "mac")
DEFAULT_COMPRESSION_BLOCK = 256
USER, ADVANCED = "user", "advanced"
MAX_USER_SETTINGS = 10  # what a user must read stays one short table


@dataclass(frozen=True)
class Setting:
    name: str
    audience: str  # USER or ADVANCED: the table of docs/configuration.md that documents it
    default: str  # as docs/configuration.md's "default" column shows it


SETTINGS: tuple[Setting, ...] = (
    Setting("THUNDERBOLT_TRANSPORT", USER, "auto"),
    Setting("THUNDERBOLT_IFNAME", USER, "(the interface towards MASTER_ADDR)"),
    Setting("THUNDERBOLT_SECRET", USER, "(unset)"),
    Setting("THUNDERBOLT_INTEGRITY", USER, "none"),
    Setting("THUNDERBOLT_PORT", USER, "0"),
    Setting("THUNDERBOLT_CONNECT_TIMEOUT", USER, "120"),
    Setting("THUNDERBOLT_STREAMS", USER, "2"),
    Setting("THUNDERBOLT_COMPRESSION", USER, "none"),
    Setting("THUNDERBOLT_DEBUG", USER, "0"),
    Setting("THUNDERBOLT_LINK_TIMEOUT_MS", ADVANCED, "3000"),
    Setting("THUNDERBOLT_LISTEN_ALL", ADVANCED, "0"),
    Setting("THUNDERBOLT_ALGO", ADVANCED, "auto"),
    Setting("THUNDERBOLT_SMALL", ADVANCED, "64K"),
    Setting("THUNDERBOLT_CHUNK", ADVANCED, "1M"),
    Setting("THUNDERBOLT_STRIPE", ADVANCED, "256K"),
    Setting("THUNDERBOLT_SOCKET_BUFFER", ADVANCED, "4M"),
    Setting("THUNDERBOLT_CC", ADVANCED, "(the system's)"),
    Setting("THUNDERBOLT_COMPRESSION_BLOCK", ADVANCED, "256"),
    Setting("THUNDERBOLT_SHM_SLOT", ADVANCED, "1M"),
    Setting("THUNDERBOLT_SHM_SLOTS", ADVANCED, "8"),
    Setting("THUNDERBOLT_SHM_WINDOW", ADVANCED, "1M (4M when ranks outnumber cores)"),
    Setting("THUNDERBOLT_SHM_DIR", ADVANCED, "(POSIX shared memory)"),
    Setting("THUNDERBOLT_VERBS", ADVANCED, "system"),
    Setting("THUNDERBOLT_AUTOLOAD", ADVANCED, "1"),
    Setting("THUNDERBOLT_KEEP_AWAKE", ADVANCED, "1"),
    Setting("THUNDERBOLT_LAB_STATE_DIR", ADVANCED, "/run/torch-thunderbolt"),
)
SETTING_NAMES = frozenset(s.name for s in SETTINGS)

# Where a THUNDERBOLT_VERBS=NAME:ARG provider lives: transport/providers.py imports the module by this name
# only when a job names it, as it would a plugin, so the runtime holds no import of testing/.
VERBS_PROVIDERS: dict[str, str] = {"fake": "torch_thunderbolt.testing.fake_verbs"}


def parse_size(text: str, name: str = "size") -> int:
    """'4K' / '1M' / '2G' / '4096' -> bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if mult != 1 else t
    try:
        number = float(digits) * mult
    except ValueError:
        raise ConfigError(f"{name}: expected a size like 4096, 64K, 1M or 2G, got {text!r}") from None
    if not math.isfinite(number):  # 'inf', 'nan', '1e400': int() of these raises OverflowError/ValueError
        raise ConfigError(f"{name}: expected a finite size like 4096, 64K, 1M or 2G, got {text!r}")
    value = int(number)
    if value < 0:
        raise ConfigError(f"{name}: must not be negative, got {text!r}")
    return value


# The accepted range of every size variable (bytes, inclusive), checked when the Config is parsed so a value
# that parses but cannot work fails before any traffic.
SIZE_RANGES: dict[str, tuple[int, int]] = {
    # Pipeline pieces are buffers: below 1K per-piece overhead dominates, above 1G no pipelining is left.
    "THUNDERBOLT_CHUNK": (1 << 10, 1 << 30),
    # Thresholds only (0 = never small / always striped; a huge value = always small / never striped).
    "THUNDERBOLT_SMALL": (0, 1 << 40),
    "THUNDERBOLT_STRIPE": (0, 1 << 40),
    # SO_SNDBUF/SO_RCVBUF of 0 or 1 byte (the kernel rounds them up to a few KB) made a 1.2 MB all_reduce
    # hang until the timeout; 64K is the smallest tested to work. setsockopt takes a C int: at most 2**31-1.
    "THUNDERBOLT_SOCKET_BUFFER": (64 << 10, (1 << 31) - 1),
    # Shared-memory sizes are mapped pages: multiples of 4K (SHM_WINDOW also 0 = no window), see _pages.
    "THUNDERBOLT_SHM_SLOT": (4 << 10, 1 << 30),
    "THUNDERBOLT_SHM_WINDOW": (4 << 10, 1 << 30),
}


def _human(n: int) -> str:
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _size(text: str, name: str) -> int:
    """A size variable within its SIZE_RANGES entry."""
    lo, hi = SIZE_RANGES[name]
    value = parse_size(text, name)
    if not lo <= value <= hi:
        raise ConfigError(f"{name}: expected a size of at least {_human(lo)} and at most {_human(hi)} bytes, "
                          f"got {text!r}")
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
    port: int = 0  # THUNDERBOLT_PORT: the first listening port to try (0 = any free one); see parse_port
    port_range: tuple[int, int] = (0, 0)  # the ports a listener may take (inclusive); (0, 0) = `port` alone
    connect_timeout: float = 120.0  # THUNDERBOLT_CONNECT_TIMEOUT seconds
    compression: str = "none"  # THUNDERBOLT_COMPRESSION (lossy, float all_reduce only)
    compression_block: int = DEFAULT_COMPRESSION_BLOCK  # THUNDERBOLT_COMPRESSION_BLOCK: int8 values per scale
    congestion_control: str = ""  # THUNDERBOLT_CC: per-socket TCP congestion control (Linux), e.g. cubic
    # Busy-poll this long before sleeping (0 = never), no setting: a 2-rank ping-pong over loopback TCP waits
    # ~70 µs per round trip, so a shorter spin ends in a wake-up each time, and the set-up turns it off where
    # a host has more ranks than cores (rendezvous/tcp.py, rendezvous/rdma.py).
    spin_us: int = 200
    link_timeout_ms: int = 3000  # THUNDERBOLT_LINK_TIMEOUT_MS: data unacknowledged this long = link lost
    debug: bool = False  # THUNDERBOLT_DEBUG=1: full per-op signature checks and verbose logs
    # Shared-memory transport (read by rendezvous/shm.py from the Config it is given):
    shm_slot_bytes: int = 1 << 20  # THUNDERBOLT_SHM_SLOT: payload bytes per ring slot (multiple of 4K, 4K-1G)
    shm_slots: int = 8  # THUNDERBOLT_SHM_SLOTS: slots per directed pair (2-1024)
    shm_spin_us: int | None = None  # spin before blocking, no setting; None = automatic (100 µs, or 0 when
    # ranks outnumber cores: see shm.default_spin), so it depends on the rank count, known later
    shm_window_bytes: int | None = None  # THUNDERBOLT_SHM_WINDOW: bytes per shared-window buffer; None =
    # automatic by rank count (rendezvous.shm.default_window_bytes), 0 = no window (collectives use the rings)
    shm_dir: str = ""  # THUNDERBOLT_SHM_DIR: existing writable directory for file-backed segments ("" = POSIX shm)
    # THUNDERBOLT_VERBS: where the RDMA verbs come from: "system" (librdma.dylib on macOS, libibverbs.so.1 on
    # Linux) or "fake" with verbs_fabric = the fake fabric's directory (THUNDERBOLT_VERBS=fake:/path), the
    # test double of VERBS_PROVIDERS["fake"]; never a measure of RDMA speed.
    verbs: str = "system"
    verbs_fabric: str = ""
    autoload: bool = True  # THUNDERBOLT_AUTOLOAD=0: `import torch` does not register the backend
    keep_awake: bool = True  # THUNDERBOLT_KEEP_AWAKE=0: no power assertion keeps a Mac awake (backend/keep_awake.py)
    # THUNDERBOLT_SECRET (or @file): the job's private key for the stream handshake; b"" = derive it from
    # the rendezvous store, which anyone who reaches MASTER_PORT can read. repr=False: never printed.
    secret: bytes = field(default=b"", repr=False)
    # THUNDERBOLT_INTEGRITY=mac: a keyed BLAKE2b MAC on every TCP frame (protocol/integrity.py), for cables
    # that are not trusted; needs THUNDERBOLT_SECRET (without it the key is in the rendezvous store).
    integrity: str = "none"
    extra: dict = field(default_factory=dict, compare=False)

    def listen_ports(self) -> list[int]:
        """The ports a listener tries, in order: 0 (any), the one port, or the range from `port` on,
        wrapping around."""
        low, high = self.port_range
        if not self.port or (low, high) == (0, 0):
            return [self.port]
        return list(range(self.port, high + 1)) + list(range(low, self.port))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Config":
        """The Config of `env` (default: this process's environment); a ConfigError naming every bad setting
        (one run shows them all, as `doctor` does)."""
        cfg, problems = cls.parse_env(env)
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ConfigError("; ".join(str(p) for p in problems))
        return cfg

    @classmethod
    def parse_env(cls, env: Mapping[str, str] | None = None) -> "tuple[Config, list[ConfigError]]":
        """Every setting of `env` parsed: the Config, each bad setting left at its default, and the ConfigError
        of each bad one, in the order they are parsed (what `from_env` raises, and `doctor` lists)."""
        env = os.environ if env is None else env
        problems = text_problems(env)
        unreadable = {str(p).partition(":")[0] for p in problems}
        get = lambda k: "" if k in unreadable else env.get(k, "").strip()  # noqa: E731
        kw: dict = {}

        def take(key: "str | tuple[str, ...]", parse: "Callable[[], object]") -> bool:
            """kw[key] = parse() (a tuple of keys takes a tuple of values), or its ConfigError noted."""
            try:
                value = parse()
            except ConfigError as exc:
                problems.append(exc)
                return False
            if isinstance(key, tuple):
                kw.update(zip(key, value))  # type: ignore[call-overload]
            else:
                kw[key] = value
            return True

        if get("THUNDERBOLT_IFNAME"):
            kw["ifnames"] = tuple(x.strip() for x in get("THUNDERBOLT_IFNAME").split(",") if x.strip())
        if get("THUNDERBOLT_STREAMS"):
            take("streams", lambda: _int(get("THUNDERBOLT_STREAMS"), "THUNDERBOLT_STREAMS", 1, 64))
        take("transport", lambda: _choice(get("THUNDERBOLT_TRANSPORT") or "auto", "THUNDERBOLT_TRANSPORT",
                                          TRANSPORTS))
        take("algo", lambda: _choice(get("THUNDERBOLT_ALGO") or "auto", "THUNDERBOLT_ALGO", ALGOS))
        take("compression", lambda: _compression(get("THUNDERBOLT_COMPRESSION")))
        take("compression_block", lambda: _compression_block(get("THUNDERBOLT_COMPRESSION_BLOCK")))
        for var, key in (("THUNDERBOLT_CHUNK", "chunk_bytes"), ("THUNDERBOLT_SMALL", "small_bytes"),
                         ("THUNDERBOLT_STRIPE", "stripe_bytes"), ("THUNDERBOLT_SOCKET_BUFFER", "socket_buffer")):
            if get(var):
                take(key, lambda var=var: _size(get(var), var))  # type: ignore[misc]
        if get("THUNDERBOLT_SHM_SLOT"):
            take("shm_slot_bytes", lambda: _pages(get("THUNDERBOLT_SHM_SLOT"), "THUNDERBOLT_SHM_SLOT", zero_ok=False))
        if get("THUNDERBOLT_SHM_WINDOW"):
            take("shm_window_bytes", lambda: _pages(get("THUNDERBOLT_SHM_WINDOW"), "THUNDERBOLT_SHM_WINDOW",
                                                    zero_ok=True))
        if get("THUNDERBOLT_SHM_SLOTS"):
            take("shm_slots", lambda: _int(get("THUNDERBOLT_SHM_SLOTS"), "THUNDERBOLT_SHM_SLOTS", 2, 1024))
        if get("THUNDERBOLT_SHM_DIR"):
            take("shm_dir", lambda: _shm_dir(get("THUNDERBOLT_SHM_DIR"), "THUNDERBOLT_SHM_DIR"))
        take("autoload", lambda: _autoload(get("THUNDERBOLT_AUTOLOAD")))
        take(("verbs", "verbs_fabric"), lambda: parse_verbs(get("THUNDERBOLT_VERBS")))
        if get("THUNDERBOLT_LINK_TIMEOUT_MS"):
            take("link_timeout_ms", lambda: _int(get("THUNDERBOLT_LINK_TIMEOUT_MS"), "THUNDERBOLT_LINK_TIMEOUT_MS",
                                                 500, 600_000))
        if get("THUNDERBOLT_PORT"):
            take(("port", "port_range"), lambda: parse_port(get("THUNDERBOLT_PORT"),
                                                            env.get("LOCAL_RANK", "").strip()))
        if get("THUNDERBOLT_CONNECT_TIMEOUT"):
            take("connect_timeout", lambda: float(_int(get("THUNDERBOLT_CONNECT_TIMEOUT"),
                                                       "THUNDERBOLT_CONNECT_TIMEOUT", 1, 86400)))
        take("listen_all", lambda: _flag(get("THUNDERBOLT_LISTEN_ALL"), "THUNDERBOLT_LISTEN_ALL"))
        take("keep_awake", lambda: _flag(get("THUNDERBOLT_KEEP_AWAKE") or "1", "THUNDERBOLT_KEEP_AWAKE"))
        take("debug", lambda: _flag(get("THUNDERBOLT_DEBUG"), "THUNDERBOLT_DEBUG") or env.get(
            "TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")
        kw["congestion_control"] = get("THUNDERBOLT_CC")
        secret_ok = not get("THUNDERBOLT_SECRET") or take("secret", lambda: parse_secret(get("THUNDERBOLT_SECRET")))
        if take("integrity", lambda: _choice(get("THUNDERBOLT_INTEGRITY") or "none", "THUNDERBOLT_INTEGRITY",
                                             INTEGRITY_MODES)) and secret_ok:
            if kw["integrity"] != "none" and not kw.get("secret"):
                problems.append(ConfigError(
                    "THUNDERBOLT_INTEGRITY=mac needs THUNDERBOLT_SECRET (the same on every rank): without it the "
                    "frames' key would come from the rendezvous store, which anyone who reaches MASTER_PORT can "
                    "read"))
                kw["integrity"] = "none"
        return cls(**kw), problems


def parse_port(text: str, local_rank: str) -> tuple[int, tuple[int, int]]:
    """THUNDERBOLT_PORT -> (first port to try, (lowest, highest) port a listener may take).

    `P`: a base port. Each rank listens on P + LOCAL_RANK (torchrun and `launch` number a host's ranks 0, 1,
    ...), so K ranks of one Mac use P..P+K-1 and a firewall can open exactly those. `P-Q`: a range. A rank
    tries P + LOCAL_RANK first (wrapping within the range) and takes the next free port when that one is
    in use, so it works without LOCAL_RANK and beside other programs. `0`: any free port."""
    name = "THUNDERBOLT_PORT"
    low_text, dash, high_text = text.partition("-")
    try:
        low, high = int(low_text), int(high_text if dash else low_text)
    except ValueError:
        low = high = -1
    if not (0 <= low <= high <= 65535) or (dash and low == 0):
        raise ConfigError(f"{name}: expected a base port (29600: each rank of a host listens on 29600 + LOCAL_RANK), "
                          f"a range (29600-29615: each rank takes a free port in it) or 0 (any free port), got {text!r}")
    if low == 0:
        return 0, (0, 0)
    offset = _int(local_rank, "LOCAL_RANK", 0, 65535) if local_rank else 0
    if not dash:
        if low + offset > 65535:
            raise ConfigError(f"{name}={text} with LOCAL_RANK={offset}: this rank's port would be {low + offset}, "
                              f"beyond 65535; choose a lower base port")
        return low + offset, (low + offset, low + offset)
    return low + offset % (high - low + 1), (low, high)

def job_settings(cfg: Config) -> dict[str, str]:
    """The settings every rank of a group must share, as their variables name them (values as a user would
    write them): each changes what goes on the wire or how a result is computed, so ranks that differ would
    read each other's bytes wrongly, disagree on an op's messages or wait for connections that never come.
    rendezvous/agree.py compares them at set-up. TCP-only ones only count where TCP may be used; the int8
    block size only where int8 compression is on (nothing else reads it).

    Left out, because each rank may set them for itself: interfaces, addresses and ports (IFNAME, PORT,
    LISTEN_ALL: where this rank listens), the set-up and link timeouts (CONNECT_TIMEOUT, LINK_TIMEOUT_MS:
    how long this rank waits, or its kernel's limit for its own sockets), socket buffers and congestion
    control (SOCKET_BUFFER, CC: this rank's sockets), SHM_DIR (peers map a segment by the path its creator
    published), DEBUG (logging only), AUTOLOAD and VERBS (where this rank loads its RDMA library from).
    THUNDERBOLT_SECRET must agree too, but the set-up compares it without publishing it (its records' MACs
    and the handshake)."""
    out = {"THUNDERBOLT_TRANSPORT": cfg.transport, "THUNDERBOLT_ALGO": cfg.algo,
           "THUNDERBOLT_SMALL": _human(cfg.small_bytes), "THUNDERBOLT_CHUNK": _human(cfg.chunk_bytes),
           "THUNDERBOLT_COMPRESSION": cfg.compression}
    if cfg.compression == "int8":
        out["THUNDERBOLT_COMPRESSION_BLOCK"] = str(cfg.compression_block)
    if cfg.transport != "shm":
        out["THUNDERBOLT_STREAMS"] = str(cfg.streams)  # each rank expects this many streams from each peer
        out["THUNDERBOLT_STRIPE"] = _human(cfg.stripe_bytes)  # a receive guesses from it how a peer cuts a message
        out["THUNDERBOLT_INTEGRITY"] = cfg.integrity  # sealed frames are unreadable to a rank that expects plain ones
    return out


def host_settings(cfg: Config) -> dict[str, str]:
    """The settings the ranks that share memory on one host must share: the layout of the segments they map
    from each other (ring slots, the shared window). Ranks on different hosts never map each other's."""
    if cfg.transport == "tcp":
        return {}
    window = "auto" if cfg.shm_window_bytes is None else _human(cfg.shm_window_bytes)
    return {"THUNDERBOLT_SHM_SLOT": _human(cfg.shm_slot_bytes), "THUNDERBOLT_SHM_SLOTS": str(cfg.shm_slots),
            "THUNDERBOLT_SHM_WINDOW": window}


def check_text(env: Mapping[str, str]) -> None:
    """A ConfigError naming the first THUNDERBOLT_* variable whose value is not valid UTF-8 (`text_problems`)."""
    problems = text_problems(env)
    if problems:
        raise problems[0]


def text_problems(env: Mapping[str, str]) -> list[ConfigError]:
    """A ConfigError for each THUNDERBOLT_* variable whose value is not valid UTF-8, naming it. Python hands
    such bytes over as lone surrogates (os.environ decodes with surrogateescape), which pass every parser
    here and fail much later (UnicodeEncodeError at a socket option, or at the secret's first use). The
    value is never shown: it may be the secret."""
    out = []
    for name, value in env.items():
        if not isinstance(name, str) or not name.startswith("THUNDERBOLT_") or not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            out.append(ConfigError(f"{name}: expected UTF-8 text, but the value holds bytes that are not (value "
                                   f"not shown); set it again from a UTF-8 terminal or file"))
    return out


SECRET_MIN_CHARS = 32  # 32 hex digits = 128 bits: out of reach of an offline guess of the handshake MAC
SECRET_MIN_DISTINCT = 8  # fewer distinct characters is no random secret (a placeholder, a repeated word)
SECRET_MAX_BYTES = 4096  # a longer "secret" file is almost surely the wrong file


def parse_secret(text: str, name: str = "THUNDERBOLT_SECRET") -> bytes:
    """The value itself, or `@/path` to a file holding it (read here, once). Used as bytes as written, so
    every rank only needs the same string; errors never quote the value."""
    where = name
    check_text({name: text})
    if text.startswith("@"):
        path = os.path.expanduser(text[1:].strip())
        where = f"{name}=@{path}"
        try:
            with open(path, "rb") as fh:
                mode = os.fstat(fh.fileno()).st_mode
                raw = fh.read(SECRET_MAX_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read the secret file ({exc.strerror or exc})") from None
        # As ssh refuses a private key others can read: with the secret, anyone who reads the file can join
        # the job and receive its tensors. (Pipes and devices, e.g. @/dev/stdin, have no such mode.)
        if stat.S_ISREG(mode) and mode & 0o077:
            raise ConfigError(f"{where}: the secret file has mode {stat.S_IMODE(mode):04o}, so other users can "
                              f"{'read' if mode & 0o044 else 'change'} it; run `chmod 600 {path}` (a mounted "
                              f"container secret: give it mode 0400 or 0600)")
        value = raw.strip()
    else:
        value = text.strip().encode()
    hint = "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`"
    if len(value) > SECRET_MAX_BYTES:
        raise ConfigError(f"{where}: expected a secret of at most {SECRET_MAX_BYTES} bytes; is this the right file?")
    if len(value) < SECRET_MIN_CHARS:
        raise ConfigError(f"{where}: expected a random secret of at least {SECRET_MIN_CHARS} characters "
                          f"(got {len(value)}, not shown); {hint}")
    if len(set(value)) < SECRET_MIN_DISTINCT:
        raise ConfigError(f"{where}: expected a random secret; this one has {len(set(value))} distinct "
                          f"characters (not shown), a random one of {SECRET_MIN_CHARS} has many more; {hint}")
    return value


def parse_compression(env: Mapping[str, str]) -> tuple[str, int]:
    """(mode, int8 block size) from THUNDERBOLT_COMPRESSION / THUNDERBOLT_COMPRESSION_BLOCK; unset: none, 256.
    One parser for the Config and compression.mode_from_env."""
    get = lambda k: env.get(k, "").strip()  # noqa: E731
    return _compression(get("THUNDERBOLT_COMPRESSION")), _compression_block(get("THUNDERBOLT_COMPRESSION_BLOCK"))


def _compression(text: str) -> str:
    return _choice(text or "none", "THUNDERBOLT_COMPRESSION", COMPRESSIONS)


def _compression_block(text: str) -> int:
    return _int(text, "THUNDERBOLT_COMPRESSION_BLOCK", 1, 1 << 20) if text else DEFAULT_COMPRESSION_BLOCK


def parse_autoload(env: Mapping[str, str]) -> bool:
    """THUNDERBOLT_AUTOLOAD (default on). torch_thunderbolt_autoload.py answers "0" without importing us."""
    return _autoload(env.get("THUNDERBOLT_AUTOLOAD", "").strip())


def _autoload(text: str) -> bool:
    return _flag(text or "1", "THUNDERBOLT_AUTOLOAD")


def parse_verbs(text: str, name: str = "THUNDERBOLT_VERBS") -> tuple[str, str]:
    """(provider, fabric directory) from THUNDERBOLT_VERBS: unset or `system` -> ("system", ""); `fake:DIR`
    -> ("fake", DIR), DIR holding a fabric (its fabric.json; testing/fake_verbs creates one)."""
    if text in ("", "system"):
        return "system", ""
    kind, _, where = text.partition(":")
    if kind not in VERBS_PROVIDERS or not where:
        raise ConfigError(f"{name}: expected 'system' or 'fake:/path/to/fabric', got {text!r}")
    fabric = os.path.abspath(os.path.expanduser(where))
    if not os.path.isfile(os.path.join(fabric, "fabric.json")):
        raise ConfigError(f"{name}={text}: {fabric} holds no fake verbs fabric (no fabric.json); create one with "
                          f"`python -m torch_thunderbolt.testing.fake_verbs create {fabric}`")
    return "fake", fabric


def lab_state_dir(env: Mapping[str, str], default: str) -> str:
    """THUNDERBOLT_LAB_STATE_DIR: where the lab tool keeps its state files (`default` when unset)."""
    return env.get("THUNDERBOLT_LAB_STATE_DIR", "").strip() or default


def _pages(text: str, name: str, zero_ok: bool) -> int:
    """A size that must be a multiple of 4K within SIZE_RANGES (or 0, where that means "none")."""
    value = parse_size(text, name)
    lo, hi = SIZE_RANGES[name]
    if (value or not zero_ok) and (not lo <= value <= hi or value % 4096):
        raise ConfigError(f"{name}: expected {'0 or ' if zero_ok else ''}a multiple of 4K from {_human(lo)} to "
                          f"{_human(hi)}, got {text!r}")
    return value


def _shm_dir(text: str, name: str, plat: Platform | None = None) -> str:
    """An existing directory where this process can create, size and map a file: what every shm segment
    does there. Probed rather than checked with os.access, which says yes to root even for /proc. The hint
    names a directory `plat` (default: this system) has: /dev/shm is Linux's alone."""
    if not os.path.isdir(text):
        what = "is not a directory" if os.path.exists(text) else "does not exist"
        raise ConfigError(f"{name}={text}: expected an existing writable directory, but it {what}; create it "
                          f"(mkdir -p) or unset {name} to use POSIX shared memory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tbt-probe-", dir=text)
        try:
            os.ftruncate(fd, 4096)
            mmap.mmap(fd, 4096).close()
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        where = (plat or current()).shm_list_dir
        examples = f"{where} or /tmp" if where else "/tmp"
        raise ConfigError(f"{name}={text}: expected a directory where shared-memory files can be created and "
                          f"mapped ({exc.strerror or exc}); choose another directory (e.g. {examples}) "
                          f"or unset {name}") from None
    return text


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


SELFCHECK_FAULTS = ("wrong", "hang")


@dataclass(frozen=True)
class Injection:
    """A fault `selfcheck --inject` plants on purpose, to test the selfcheck itself (never for real jobs):
    `wrong` makes rank `rank` corrupt its result of op family `op` (so that op's line must turn to FAIL);
    `hang` makes it stop answering at op family `op` (any op family when `op` is "", so the first check with
    collectives), which the selfcheck must name."""

    fault: str
    rank: int
    op: str = ""


def parse_injections(items: "list[str] | tuple[str, ...]", op_families: "tuple[str, ...]",
                     name: str = "--inject") -> tuple[Injection, ...]:
    """`wrong:RANK:OP` / `hang:RANK[:OP]` items (test-only faults of `selfcheck`)."""
    out = []
    for item in items:
        parts = item.strip().split(":")
        if len(parts) not in (2, 3) or parts[0] not in SELFCHECK_FAULTS or not parts[1].isdigit():
            raise ConfigError(f"{name} {item!r}: expected wrong:RANK:OP or hang:RANK[:OP] (RANK a whole number)")
        op = parts[2] if len(parts) == 3 else ""
        if parts[0] == "wrong" and not op:
            raise ConfigError(f"{name} {item!r}: wrong needs the op family, e.g. wrong:1:all_reduce")
        if op and op not in op_families:
            raise ConfigError(f"{name} {item!r}: no op family {op!r} (have: {', '.join(op_families)})")
        out.append(Injection(parts[0], int(parts[1]), op))
    return tuple(out)
