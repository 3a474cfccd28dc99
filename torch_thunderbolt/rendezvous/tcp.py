"""Setting up the TCP links of one group: addresses and a group nonce through the rendezvous store,
listeners on the chosen addresses only, authenticated streams to every peer.

Rank r connects to every lower rank and accepts from every higher one; each stream is authenticated with
the group's key (protocol.handshake), bound to the addresses both ends of that connection see. With
THUNDERBOLT_SECRET the key is derived from that private secret and the group nonce, so what the store holds
is useless to a stranger, and every record read from the store is checked (records.py), so a rewritten
endpoint fails the set-up, naming it, instead of leading a rank to a relay; without it the nonce itself is
the key, and anyone who can reach the store (MASTER_PORT, no authentication) can join, so each rank warns.
Anything else that connects is refused and logged. Listeners are closed once the group is connected, so
stray connections later get "connection refused". A rank that gives up announces why in the store, and the
ranks waiting for it raise that reason.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from ..config import Config
from ..errors import ConfigError, HandshakeError, PeerLostError, ThunderboltError, peer_lost
from ..platform import (DARWIN_TCP_RXT_CONNDROPTIME, LINUX_TCP_USER_TIMEOUT, LOCAL_NETWORK_SETTING,  # noqa: F401
                        Platform, current, spin_cores)
from ..protocol import handshake as hs
from ..protocol.integrity import stream_keys
from ..transport.engine import Transport
from ..transport.netif import Interfaces, choose_addresses, local_interfaces, network_of, resolve_ifnames
from ..transport.tcp import TcpLinks
from . import hosts
from .hosts import recv_exact
from .records import SECRET_HINT, Records
from .setup import SetUp, connect_one_kind

log = logging.getLogger("torch_thunderbolt.bootstrap")
# The no-secret warning goes on the package's top logger: it is about the whole job, not a set-up detail.
security_log = logging.getLogger("torch_thunderbolt")

NO_SECRET_WARNING = (
    "rank %d: THUNDERBOLT_SECRET is not set, so this job's TCP streams are authenticated with a key kept in "
    "the rendezvous store (MASTER_ADDR:MASTER_PORT), which has no authentication: anyone who can reach "
    "MASTER_PORT can read it, join the job in a rank's place and receive its tensors. Set the same random "
    "THUNDERBOLT_SECRET on every rank (python -c 'import secrets; print(secrets.token_hex(32))'), or start "
    "the job with `torch-thunderbolt launch`, which does this for you.")


def offer(cfg: Config) -> str | None:
    """Every rank can offer TCP links (the kind every pair falls back to)."""
    return None


def machine_problems(cfg: Config, plat: Platform | None = None,
                     interfaces: "Interfaces | None" = None) -> list[ConfigError]:
    """What this machine refuses of the settings of links over IP networks, which only it can tell (the
    Config's parsing checked their form): every THUNDERBOLT_IFNAME entry an interface or address of this
    host (`interfaces`: its table, default read now), THUNDERBOLT_CC a congestion control its kernel has.
    Every rank checks them whatever kinds of link it will use (`check_machine`); doctor runs the same checks
    (`choose_addresses`, `congestion_control_problem`)."""
    problems = []
    if cfg.ifnames:
        try:
            resolve_ifnames(cfg.ifnames, local_interfaces() if interfaces is None else interfaces)
        except ConfigError as exc:
            problems.append(exc)
    cc = congestion_control_problem(cfg.congestion_control, plat)
    if cc is not None:
        problems.append(cc)
    return problems


def congestion_control_problem(cc: str, plat: Platform | None = None) -> ConfigError | None:
    """THUNDERBOLT_CC=`cc` tried on a socket that is never connected: None where it is unset, works, or does
    nothing on this platform (`SocketTuner` warns then), else the ConfigError a TCP link would raise."""
    plat = plat or current()
    if not cc or not plat.tcp_congestion or not hasattr(socket, "TCP_CONGESTION"):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        except (OSError, UnicodeEncodeError) as exc:
            return ConfigError(f"THUNDERBOLT_CC={cc!r}: not available here ({exc}); unset it, or name one this "
                               f"kernel has (sysctl net.ipv4.tcp_available_congestion_control)")
    return None


def check_machine(cfg: Config, rank: "int | str" = "") -> None:
    """`machine_problems` as this rank's ConfigError, naming the rank (where known) and every problem."""
    problems = machine_problems(cfg)
    if problems:
        raise ConfigError(("" if rank == "" else f"rank {rank}: ") + "; ".join(str(p) for p in problems))


def local_addresses(store: Any, cfg: Config, rank: int) -> list[str]:
    """The addresses this rank's links over IP networks use: THUNDERBOLT_IFNAME's, else the one towards the
    store's host; a ConfigError naming the rank where there is none."""
    try:
        return choose_addresses(cfg.ifnames, store_host(store))
    except ConfigError as exc:
        raise ConfigError(f"rank {rank}: {exc}") from exc.__cause__


def local_networks(store: Any, cfg: Config, rank: int) -> list[str]:
    """The networks (CIDR) of the addresses this rank's TCP links use (`local_addresses`). The cluster's
    cabling, as the algorithms see it."""
    return [network_of(a) for a in local_addresses(store, cfg, rank)]


def store_host(store: Any) -> str | None:
    """The TCPStore host behind (possibly prefixed) `store`, or MASTER_ADDR, or None."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return os.environ.get("MASTER_ADDR") or None


MIN_SOCKET_BUFFER = 64 << 10  # below this, keep the system's default rather than shrink further


class SocketTuner:
    """Applies the job's socket options to every socket of one transport set-up, on `plat`: `tune` before a
    socket connects or listens, `established` on every stream once it is connected or accepted.

    It remembers the buffer size the system accepted: macOS up to 14.3 refuses SO_SNDBUF/SO_RCVBUF above its
    limit with ENOBUFS, so the size is halved until accepted and later sockets start there; macOS 14.4 and
    later (uipc_socket2.c:803-815) and Linux grant less than asked without a word, which the size read back
    shows. Either way the set-up warns once, not once per socket. THUNDERBOLT_CC where TCP_CONGESTION does
    not exist (macOS) is one warning too: it does nothing there."""

    def __init__(self, cfg: Config, plat: Platform | None = None, rank: int | None = None) -> None:
        self.cfg, self.plat = cfg, plat or current()
        self.who = "" if rank is None else f"rank {rank}: "
        self.buffer = cfg.socket_buffer  # what the last socket was given (0 = the system's default)
        self._warned_buffer = self._warned_cc = False

    def tune(self, sock: socket.socket) -> None:
        """Before `sock` connects or listens: the buffer sizes (the window scale is fixed by the handshake)
        and the options of `established`, but TCP_NODELAY."""
        self._set_buffers(sock)
        self._connection_options(sock)

    def established(self, sock: socket.socket) -> None:
        """Every stream once connected or accepted: the per-connection options again, and TCP_NODELAY. XNU
        gives an accepted socket neither its listener's TCP_RXT_CONNDROPTIME nor its keepalive idle time
        (tcp_input.c:2883-2898; Linux copies both), so no stream relies on what it inherited."""
        self._connection_options(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _connection_options(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # Half-open connections (a frozen or unplugged peer) are found within ~15 s even when idle.
        for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPALIVE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, name):
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
                except OSError:
                    pass
        for level, option, value in link_timeout_options(self.plat, self.cfg.link_timeout_ms):
            try:
                sock.setsockopt(level, option, value)
            except OSError as exc:
                log.warning("could not set the link timeout (option %#x = %d): %s", option, value, exc)
        cc = self.cfg.congestion_control
        if cc and (not self.plat.tcp_congestion or not hasattr(socket, "TCP_CONGESTION")):
            if not self._warned_cc:
                self._warned_cc = True
                log.warning("%sTHUNDERBOLT_CC=%s does nothing on %s: it has no per-socket TCP congestion "
                            "control (TCP_CONGESTION); unset it", self.who, cc, self.plat.name)
        elif cc:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
            except UnicodeEncodeError:  # a Config made without from_env, which refuses such values
                raise ConfigError(f"{self.who}THUNDERBOLT_CC={cc!r}: expected the name of a congestion control "
                                  f"algorithm in UTF-8 text, e.g. cubic") from None
            except OSError as exc:
                raise ConfigError(f"{self.who}THUNDERBOLT_CC={cc}: not available here ({exc})") from exc

    def _set_buffers(self, sock: socket.socket) -> None:
        wanted = self.buffer
        granted = 0
        while self.buffer:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.buffer)
                granted = min(sock.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF))
                granted //= self.plat.sockbuf_reported_factor
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS or self.plat.sockbuf_over_limit != "enobufs":
                    raise
                # Above the system's limit (macOS: about kern.ipc.maxsockbuf * 8/9): try half.
                self.buffer = self.buffer // 2 if self.buffer // 2 >= MIN_SOCKET_BUFFER else 0
        if self.buffer != wanted and not self._warned_buffer:
            self._warned_buffer = True
            got = f"{self.buffer} bytes" if self.buffer else "the system's default"
            log.warning("%sTHUNDERBOLT_SOCKET_BUFFER=%d is above this system's socket buffer limit (ENOBUFS); "
                        "using %s instead. Raise the limit (macOS: sudo sysctl kern.ipc.maxsockbuf=...) or "
                        "lower THUNDERBOLT_SOCKET_BUFFER", self.who, self.cfg.socket_buffer, got)
        elif self.buffer and granted < self.buffer and not self._warned_buffer:
            self._warned_buffer = True
            log.warning("%sTHUNDERBOLT_SOCKET_BUFFER=%d: this system granted %d bytes per socket buffer, not the "
                        "%d asked (it caps them silently). Raise its limit (macOS: sudo sysctl "
                        "kern.ipc.maxsockbuf=...; Linux: net.core.rmem_max and net.core.wmem_max) or lower "
                        "THUNDERBOLT_SOCKET_BUFFER", self.who, self.cfg.socket_buffer, granted, self.buffer)


def tune_socket(sock: socket.socket, cfg: Config, plat: Platform | None = None) -> None:
    """Tune one socket (a set-up with many sockets keeps one SocketTuner instead, to warn once)."""
    SocketTuner(cfg, plat).tune(sock)


def effective_socket_buffer(cfg: Config, plat: Platform | None = None) -> int:
    """Bytes of socket buffer a stream of this job gets here (for `doctor`): what the system accepted,
    as it reports it (Linux caps silently, so its report is what counts)."""
    plat = plat or current()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        tuner = SocketTuner(cfg, plat)
        tuner._warned_buffer = True  # (the caller reports the size itself)
        tuner._set_buffers(sock)
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // plat.sockbuf_reported_factor


def link_timeout_options(platform: "str | Platform", timeout_ms: int) -> list[tuple[int, int, int]]:
    """(level, option, value) that make the kernel fail a stream whose sent data stays unacknowledged for
    `timeout_ms` (a pulled cable) — the error that starts failover, or PeerLostError with one cable.
    `platform`: a Platform, or a system name as Platform.for_system takes ("linux", "darwin")."""
    plat = Platform.for_system(platform) if isinstance(platform, str) else platform
    if plat.link_timeout is None:
        return []
    level, option, unit_ms = plat.link_timeout
    return [(level, option, max(1, -(-timeout_ms // unit_ms)))]


OPEN_FILES_MARGIN = 64  # files the rest of the process (torch, the store, logs, shm doorbells) may hold


def ensure_open_files(needed: int, rank: int | None = None,
                      getrlimit: Callable[[int], tuple[int, int]] | None = None,
                      setrlimit: Callable[[int, tuple[int, int]], None] | None = None) -> int:
    """Raise the soft open-file limit to `needed` (capped at the hard limit) when it is lower; the soft
    limit afterwards. macOS starts at 256, which a large job's sockets (peers x streams, twice during the
    set-up) exceed, and then connect/accept fail with EMFILE long after the cause."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return needed
    getrlimit = getrlimit or resource.getrlimit
    setrlimit = setrlimit or resource.setrlimit
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("%scould not raise the open-file limit from %d to %d (%s); this job may need %d: raise "
                    "it with `ulimit -n %d`", "" if rank is None else f"rank {rank}: ", soft, target, exc,
                    needed, needed)
        return soft
    if target < needed:
        log.warning("%sthe open-file limit is %d (hard limit), this job may need %d: raise the hard limit",
                    "" if rank is None else f"rank {rank}: ", target, needed)
    return target


class _Acceptor:
    """Accepts and authenticates the streams of every higher rank, each handshake on its own thread.

    A stranger's connection is refused and logged, and the set-up goes on. Two things end it at once
    (`fatal`): a connection from an expected rank that proved the job's private key (THUNDERBOLT_SECRET) but
    was relayed (that rank was led to a stranger's address: it can never connect directly, and the store
    was tampered with), and a peer record that fails its check."""

    def __init__(self, listeners: list[socket.socket], rank: int, world: int, streams: int, secret: bytes,
                 group_id: str, peer_addrs: "Callable[[int], set[str]]", cfg: Config, deadline: float,
                 higher: "set[int] | None" = None, tuner: "SocketTuner | None" = None) -> None:
        self.listeners, self.rank, self.world, self.streams = listeners, rank, world, streams
        self.secret, self.group_id, self.peer_addrs, self.cfg = secret, group_id, peer_addrs, cfg
        self.deadline = deadline
        self.tuner = tuner or SocketTuner(cfg, rank=rank)
        self.higher = set(range(rank + 1, world)) if higher is None else higher
        self.expected = len(self.higher) * streams
        self.conns: dict[tuple[int, int], socket.socket] = {}
        self.sessions: dict[tuple[int, int], bytes] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"tb-accept-{rank}", daemon=True)
        self.rejected = 0
        self.last_refusal = ""  # why the last stranger (or misconfigured rank) was refused, for the timeout
        # Refusals of a well-formed HELLO from an expected rank whose MAC was wrong: a rank with another
        # THUNDERBOLT_SECRET (or a stranger who read the store): only these earn the hint about the secret.
        self.bad_mac: dict[int, str] = {}
        self.fatal: BaseException | None = None

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(2.0)

    def start(self) -> None:
        if self.expected == 0:
            self.done.set()
        self.thread.start()

    def _loop(self) -> None:
        for lst in self.listeners:
            lst.settimeout(0.2)
        while not self.done.is_set() and time.monotonic() < self.deadline:
            for lst in self.listeners:
                try:
                    sock, addr = lst.accept()
                except (socket.timeout, BlockingIOError):
                    continue
                except OSError:
                    return
                threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _claim(self, src_ip: str, rank: int, stream: int) -> bool:
        if rank not in self.higher:
            return False
        try:
            allowed = self.peer_addrs(rank)  # published before that rank connects, so this never waits
        except ThunderboltError as exc:  # its record failed its check: nobody can be accepted as that rank
            self._end(exc)
            return False
        if not self.cfg.listen_all and src_ip not in allowed and "0.0.0.0" not in allowed:
            log.warning("rank %d: refused rank %d's stream from unexpected address %s (expected %s)",
                        self.rank, rank, src_ip, sorted(allowed))
            return False
        with self.lock:
            if (rank, stream) in self.conns:
                return False
            self.conns[(rank, stream)] = None  # reserved
            return True

    def _end(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.done.set()

    def _handshake(self, sock: socket.socket, addr: tuple) -> None:
        try:
            local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
        except OSError:
            sock.close()
            return
        server = hs.ServerHandshake(self.secret, self.rank, self.group_id,
                                    lambda r, s: self._claim(addr[0], r, s), self.streams, local=local, peer=peer)
        try:
            sock.settimeout(10.0)
            try:
                sock.sendall(server.challenge())
                head = sock.recv(hs.HELLO_SIZE)
            except OSError:
                head = b""
            if not head:  # closed before a word: a waiting rank checking that we are alive (_refuses)
                sock.close()
                return
            result = server.receive(head + recv_exact(sock, hs.HELLO_SIZE - len(head)))
            sock.sendall(server.reply)
        except (HandshakeError, OSError) as exc:
            why = getattr(exc, "why", "")
            self.rejected += 1
            self.last_refusal = f"{addr[0]}: {exc}"
            log.warning("rank %d: refused a connection from %s:%s: %s", self.rank, addr[0], addr[1], exc)
            if server.reply:
                try:
                    sock.sendall(server.reply)
                except OSError:
                    pass
            sock.close()
            if why == "mac" and server.claimed_rank in self.higher:
                self.bad_mac[server.claimed_rank] = f"{addr[0]}: {exc}"
            elif why == "relay" and self.cfg.secret and server.claimed_rank in self.higher:
                # Only a holder of the private key makes a HELLO whose MAC checks out (without a secret,
                # anyone who read the store can, and is merely refused).
                self._end(HandshakeError(
                    f"rank {self.rank}: {exc}. A rank that knows the job's key reached this rank through a relay: "
                    f"the rendezvous store was tampered with (record tb/ep/{self.rank}, this rank's endpoints, "
                    f"was rewritten to point elsewhere); restart every rank and firewall MASTER_PORT (README, "
                    f"Security)", why="relay"))
            return
        self.tuner.established(sock)
        with self.lock:
            self.conns[(result.peer_rank, result.stream)] = sock
            self.sessions[(result.peer_rank, result.stream)] = result.session
            if sum(1 for s in self.conns.values() if s is not None) == self.expected:
                self.done.set()


def _listen(address: str, cfg: Config, rank: int | None = None, tuner: SocketTuner | None = None) -> socket.socket:
    bind_to = "0.0.0.0" if cfg.listen_all else address
    who = "" if rank is None else f"rank {rank}: "
    for port in cfg.listen_ports():  # one port, or THUNDERBOLT_PORT's range: the first free one
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        (tuner or SocketTuner(cfg, rank=rank)).tune(sock)
        try:
            sock.bind((bind_to, port))
            sock.listen(128)  # inside the try: Linux lets two SO_REUSEADDR sockets bind a port neither listens on
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE and port:
                continue
            raise ConfigError(f"{who}cannot listen on {bind_to}:{port or '(any free port)'}: {exc}; check that "
                              f"{bind_to} is an address of this host (THUNDERBOLT_IFNAME)") from exc
    low, high = cfg.port_range
    if low != high:
        raise ConfigError(f"{who}THUNDERBOLT_PORT={low}-{high}: every port of the range is in use on {bind_to}; "
                          f"widen the range (one port per rank of this host and per job), or set "
                          f"THUNDERBOLT_PORT=0 (any free port)")
    # Chosen by the user: name the variable, and the ways out.
    raise ConfigError(f"{who}THUNDERBOLT_PORT: cannot listen on {bind_to}:{cfg.port} (address already in use); "
                      f"is another job, or another rank of this host, using it? A base port gives each rank "
                      f"port + LOCAL_RANK (torchrun and `launch` set LOCAL_RANK); a range (THUNDERBOLT_PORT={cfg.port}-"
                      f"{min(cfg.port + 15, 65535)}) lets each rank take a free port; THUNDERBOLT_PORT=0 takes any")


# macOS 15+ answers a connection to a directly attached subnet with one of these when the app the process
# runs under lacks the Local Network permission; this many in a row to one peer and we stop retrying.
LOCAL_NETWORK_ERRNOS = (errno.EPERM, errno.EHOSTUNREACH)
LOCAL_NETWORK_TRIES = 3


def local_network_denied(rank: int, peer: int, target: tuple[str, int], exc: OSError) -> ConfigError:
    return ConfigError(
        f"rank {rank}: macOS refused the connection to rank {peer} at {target[0]}:{target[1]} "
        f"({errno.errorcode.get(exc.errno or 0, exc.errno)}, {LOCAL_NETWORK_TRIES} times): the app this python "
        f"runs under (Terminal, iTerm, VS Code, tmux's terminal, a notebook app) most likely lacks the Local "
        f"Network permission. Allow it in {LOCAL_NETWORK_SETTING} and restart that app (an ssh session is not "
        f"affected); if it is allowed, check the cable and address of rank {peer} "
        f"(`torch-thunderbolt doctor` probes MASTER_ADDR)")


def _tcp_socket() -> socket.socket:
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM)


# A rank listens before it publishes its endpoint and keeps listening until the group is connected, so an
# endpoint from the store that refuses connections this long belongs to a rank that died (or gave up)
# during set-up: say so now rather than retry until the connect deadline.
REFUSED_DEAD_SECONDS = 1.0
PROBE_AFTER = 1.0  # a waiting rank starts checking the listeners of ranks that have not connected after this
PROBE_EVERY = 0.25


def died_in_setup(rank: int, peer: int, target: tuple[str, int], refused_for: float,
                  exc: BaseException) -> PeerLostError:
    """What a rank reports when `peer`'s published endpoint refuses connections: it is gone."""
    return peer_lost(
        rank, peer, f"rank {peer} died (or gave up) during set-up: it published its endpoint "
        f"{target[0]}:{target[1]}, which has refused connections for {refused_for:.1f}s ({exc}). Look at "
        f"rank {peer}'s output and exit status; every rank must be restarted",
        address=f"{target[0]}:{target[1]}")


def _refuses(target: tuple[str, int]) -> BaseException | None:
    """The refusal if nothing listens at `target` now (None if something does, or we cannot tell)."""
    try:
        with socket.create_connection(target, timeout=1.0):
            return None
    except ConnectionRefusedError as exc:
        return exc
    except OSError:
        return None


def _connect(rank: int, peer: int, stream: int, target: tuple[str, int], source: str, secret: bytes,
             group_id: str, cfg: Config, deadline: float, tuner: SocketTuner | None = None,
             new_socket: Callable[[], socket.socket] = _tcp_socket, records: Records | None = None,
             kind: str = "") -> socket.socket:
    """One authenticated stream to `peer` (retrying refused connections until `deadline`). Where the
    platform has Local Network privacy (macOS), a peer denied that way fails within a few tries."""
    return _dial(rank, peer, stream, target, source, secret, group_id, cfg, deadline, tuner, new_socket,
                 records, kind)[0]


def _dial(rank: int, peer: int, stream: int, target: tuple[str, int], source: str, secret: bytes,
          group_id: str, cfg: Config, deadline: float, tuner: SocketTuner | None = None,
          new_socket: Callable[[], socket.socket] = _tcp_socket,
          records: Records | None = None, kind: str = "") -> tuple[socket.socket, bytes]:
    """`_connect`, and the stream's own key (for per-frame MACs). `records`: where to look for `peer`'s
    announced failure when its endpoint refuses connections (its reason beats "died"); `kind`: the kind of
    link whose set-up dials (RDMA's control connections), whose giving up by `peer` counts too."""
    tuner = tuner or SocketTuner(cfg, rank=rank)
    last: Exception | None = None
    denied = 0
    refused_since: float | None = None
    while time.monotonic() < deadline:
        sock = new_socket()
        try:
            tuner.tune(sock)
            if source and source != "0.0.0.0" and not (source.startswith("127.") ^ target[0].startswith("127.")):
                sock.bind((source, 0))
            sock.settimeout(10.0)
            sock.connect(target)
            client = hs.ClientHandshake(secret, rank, peer, stream, group_id, dialled=sock.getpeername()[:2],
                                        local=sock.getsockname()[:2])
            sock.sendall(client.receive_challenge(recv_exact(sock, hs.CHALLENGE_SIZE)))
            client.receive_reply(recv_exact(sock, hs.REPLY_SIZE))
            tuner.established(sock)
            return sock, client.session
        except HandshakeError as exc:
            sock.close()
            where = f"rank {rank}: the handshake with rank {peer} at {target[0]}:{target[1]} failed: {exc}"
            if exc.why == "relay":
                raise HandshakeError(
                    f"{where}: the address in record tb/ep/{peer} does not reach rank {peer} directly but through a "
                    f"relay: the rendezvous store was tampered with; restart every rank and firewall MASTER_PORT "
                    f"(README, Security)", why="relay") from exc
            hint = f"; {SECRET_HINT}" if exc.why == "mac" else ""
            raise HandshakeError(f"{where}{hint}", why=exc.why) from exc
        except OSError as exc:
            sock.close()
            last = exc
            if (tuner.plat.local_network_privacy and exc.errno in LOCAL_NETWORK_ERRNOS
                    and not target[0].startswith("127.")):
                denied += 1
                if denied >= LOCAL_NETWORK_TRIES:
                    raise local_network_denied(rank, peer, target, exc) from exc
            else:
                denied = 0
            if isinstance(exc, ConnectionRefusedError):
                now = time.monotonic()
                refused_since = now if refused_since is None else refused_since
                if now - refused_since >= REFUSED_DEAD_SECONDS:
                    failed = records.failure(peer, kind) if records is not None else None
                    raise (failed or died_in_setup(rank, peer, target, now - refused_since, exc)) from exc
            else:
                refused_since = None
            time.sleep(0.1)
    raise peer_lost(rank, peer, f"could not connect to rank {peer} at {target[0]}:{target[1]}", cause=last,
                    address=f"{target[0]}:{target[1]}")


def stream_routes(my_addrs: list[str], my_nets: list[str], peer_eps: list, peer_nets: list[str],
                  streams: int) -> list[tuple[str, tuple[str, int]]]:
    """(source address, target endpoint) per stream. Streams go round-robin over the cables that join
    us directly (a peer address in the same network as one of ours), so two cables carry half each;
    with no direct cable, over every peer endpoint and let routing choose the source."""
    direct = [(my_addrs[i], (ep[0], ep[1])) for i, net in enumerate(my_nets)
              for j, ep in enumerate(peer_eps) if j < len(peer_nets) and peer_nets[j] == net]
    if not direct:
        direct = [("", (ep[0], ep[1])) for ep in peer_eps]
    return [direct[s % len(direct)] for s in range(streams)]


def group_key(store: Any, rank: int, private: bytes, timeout: float = 60.0) -> tuple[bytes, str]:
    """(handshake key, group id) of this group (Records.join_group): rank 0 publishes a fresh group id and
    nonce; the key is derived from `private` (THUNDERBOLT_SECRET) when there is one, else it is the published
    nonce itself."""
    auth = Records(store, rank, private, time.monotonic() + timeout).join_group()
    return auth.key, auth.group_id


def same_integrity(rank: int, cfg: Config, peer: int, info: dict) -> None:
    """A ConfigError when `peer` (its endpoint record `info`) runs another THUNDERBOLT_INTEGRITY: its frames
    would be unreadable here, and ours there."""
    theirs = info.get("integrity", "none")
    if theirs != cfg.integrity:
        raise ConfigError(f"rank {rank}: THUNDERBOLT_INTEGRITY differs: rank {peer} has {theirs!r}, this rank has "
                          f"{cfg.integrity!r}; set the same on every rank")


def _missing(acceptor: "_Acceptor", members: list[int], rank: int, streams: int) -> list[int]:
    return sorted({p for p in members if p > rank for s in range(streams) if acceptor.conns.get((p, s)) is None})


def _wait_for_higher(acceptor: "_Acceptor", records: Records, rank: int, members: list[int], streams: int,
                     deadline: float) -> "tuple[bool, PeerLostError | None]":
    """Wait for every higher rank to connect: (True, None), or (False, None) at `deadline`. Meanwhile raise
    what ends the set-up at once: a rank still missing that announced its failure (its reason), a record
    that fails its check, a relayed connection (`acceptor.fatal`). From PROBE_AFTER on, also check the
    published endpoint of each rank still missing: one that refuses connections REFUSED_DEAD_SECONDS long
    is a rank that died during set-up without a word: (False, what to say about it) at once."""
    started = time.monotonic()
    refused_since: dict[int, float] = {}
    while not acceptor.done.wait(max(0.0, min(PROBE_EVERY, deadline - time.monotonic()))):
        if acceptor.fatal is not None:
            raise acceptor.fatal
        missing = _missing(acceptor, members, rank, streams)
        records.raise_failure(missing)
        now = time.monotonic()
        if now >= deadline:
            return False, None
        if now - started < PROBE_AFTER:
            continue
        for p in missing:
            info = records.peek(f"tb/ep/{p}", p)
            if info is None:
                continue  # not even published: only the deadline can tell
            ep = info["endpoints"][0]
            if ep[0] == "0.0.0.0":
                continue
            target = (ep[0], int(ep[1]))
            exc = _refuses(target)
            if exc is None:
                refused_since.pop(p, None)
                continue
            since = refused_since.setdefault(p, now)
            if time.monotonic() - since >= REFUSED_DEAD_SECONDS:
                if acceptor.done.is_set() or all(acceptor.conns.get((p, s)) is not None for s in range(streams)):
                    continue  # its streams came in meanwhile, and it closed its listener (its set-up is done)
                failed = records.failure(p)  # it may have said why just before it closed its listener
                if failed is not None:
                    raise failed
                return False, died_in_setup(rank, p, target, time.monotonic() - since, exc)
    if acceptor.fatal is not None:
        raise acceptor.fatal
    return True, None


def connect_tcp(store: Any, rank: int, world: int, cfg: Config, timeout: float) -> Transport:
    """A transport over TCP alone, to every other rank of the group, joining the group itself (every rank
    calls this instead of group.connect; tests and tools). Rank 0 returns only once every rank has read
    what it needs from the store (which rank 0 may serve: agree.leave_together)."""
    return connect_one_kind(store, rank, world, cfg, timeout, connect_tcp_links)


def connect_tcp_links(setup: SetUp) -> TcpLinks:
    """This rank's TCP links to `setup.peers` (rank numbers stay the group's), e.g. every other rank, or the
    other hosts' ranks of a multi-host job with several ranks per host."""
    store, rank, cfg, records, auth = setup.store, setup.rank, setup.cfg, setup.records, setup.auth
    world = setup.world
    members = sorted(set(setup.peers) - {rank})
    deadline = time.monotonic() + min(setup.timeout, cfg.connect_timeout)
    tuner = SocketTuner(cfg, rank=rank)
    # Every peer's streams, twice while the listeners and handshakes overlap.
    ensure_open_files(len(members) * cfg.streams * 2 + OPEN_FILES_MARGIN, rank)
    addrs = local_addresses(store, cfg, rank)
    listeners = [_listen(a, cfg, rank, tuner) for a in (addrs[:1] if cfg.listen_all else addrs)]
    acceptor: _Acceptor | None = None
    conns: dict[int, list[socket.socket]] = {}
    sessions: dict[int, list[bytes]] = {}
    try:
        if not cfg.secret and members:
            security_log.warning(NO_SECRET_WARNING, rank)
        endpoints = [[a, lst.getsockname()[1]] for a, lst in zip(addrs, listeners)]
        nets = [network_of(a) for a in addrs]
        records.publish(f"tb/ep/{rank}", {"endpoints": endpoints, "nets": nets, "host": hosts.host_identity(),
                                          "integrity": cfg.integrity})
        # Accept before waiting for anyone: peers may connect as soon as we published our endpoint.
        acceptor = _Acceptor(listeners, rank, world, cfg.streams, auth.key, auth.group_id,
                             lambda p: {a for a, _ in records.read(f"tb/ep/{p}", p, "its endpoints")["endpoints"]},
                             cfg, deadline, {p for p in members if p > rank}, tuner)
        acceptor.start()
        lower = [p for p in members if p < rank]
        infos = {p: records.read(f"tb/ep/{p}", p, "its endpoints") for p in lower}
        for p in lower:
            same_integrity(rank, cfg, p, infos[p])
            routes = stream_routes(addrs, nets, infos[p]["endpoints"], infos[p].get("nets", []), cfg.streams)
            conns[p], sessions[p] = [], []
            for s, (source, target) in enumerate(routes):
                sock, session = _dial(rank, p, s, target, source, auth.key, auth.group_id, cfg, deadline, tuner,
                                      records=records)
                conns[p].append(sock)
                sessions[p].append(session)
        connected, dead = _wait_for_higher(acceptor, records, rank, members, cfg.streams, deadline)
        if not connected:
            missing = _missing(acceptor, members, rank, cfg.streams)
            refused = (f"; {acceptor.rejected} connection(s) were refused, the last from {acceptor.last_refusal}"
                       if acceptor.rejected else "")
            # Only a HELLO that looked like a missing rank's but did not prove the job's key earns the hint.
            bad = {p: why for p, why in acceptor.bad_mac.items() if p in missing}
            if bad:
                refused += "; " + "; ".join(f"rank {p} failed its handshake (a connection as rank {p}, from {why})"
                                            for p, why in sorted(bad.items())) + f"; {SECRET_HINT}"
            if dead is not None:  # known dead: no point waiting for the deadline
                why = str(dead).split(": ", 1)[1]
                raise peer_lost(rank, dead.peer, f"gave up waiting for ranks {missing} to connect (listening on "
                                f"{endpoints}): {why}{refused}", address=dead.address)
            err_cls = HandshakeError if bad else PeerLostError
            what = f"timed out waiting for ranks {missing} to connect (listening on {endpoints}){refused}"
            if err_cls is HandshakeError:
                raise HandshakeError(f"rank {rank}: {what}", why="mac")
            raise peer_lost(rank, missing[0] if missing else -1, what)
        for (p, s), sock in sorted(acceptor.conns.items()):
            conns.setdefault(p, []).append(sock)
            sessions.setdefault(p, []).append(acceptor.sessions[(p, s)])
        for p in members:
            same_integrity(rank, cfg, p, infos.get(p) or records.read(f"tb/ep/{p}", p, "its endpoints"))
        # Spinning only pays while every local rank has a core of its own.
        spin = cfg.spin_us if setup.local_ranks() <= spin_cores() else 0
        seal = None if cfg.integrity == "none" else (
            rank, {p: [stream_keys(key, rank, p) for key in keys] for p, keys in sessions.items()})
        return TcpLinks(conns, stripe_bytes=cfg.stripe_bytes, early_bytes=cfg.small_bytes, spin_us=spin,
                        probe_after=cfg.link_timeout_ms / 3000, seal=seal,
                        plat=tuner.plat, link_timeout=link_timeout_options(tuner.plat, cfg.link_timeout_ms))
    except BaseException as exc:
        records.announce(exc)  # before the listeners close: a peer that finds them closed reads why
        for sock in [x for socks in conns.values() for x in socks] + [
                x for x in (acceptor.conns.values() if acceptor else []) if x is not None]:
            sock.close()
        raise
    finally:
        if acceptor is not None:
            acceptor.stop()  # before closing the listeners, so no accept() keeps one alive
        for lst in listeners:
            lst.close()
