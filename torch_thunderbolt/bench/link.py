"""The raw path limit between rank 0 and rank 1: plain TCP throughput with 1..N streams, and latency.

Rank 1 listens on its address towards the master (loopback for local runs); the address and port go
to rank 0 through the control group. Rank 0 sends, one thread per stream (socket calls release the
GIL), and stops the clock when rank 1 has acknowledged every byte. Both sides know the plan (stream
counts, bytes, repeats) from the shared configuration, so no protocol beyond the bytes is needed.

Each stream count is measured twice: one way (rank 0 sends), and duplex (both send the same amount at
once, the traffic pattern of a ring all_reduce between two ranks). On one machine the two directions
share the CPUs that run TCP, so the duplex rate per direction is the ceiling for symmetric collectives.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import PeerLostError, ThunderboltError
from .metrics import percentile, summarize

CHUNK = 4 << 20           # bytes per sendall / recv_into call
PING_BYTES = 8
PING_WARMUP = 100


@dataclass(frozen=True)
class LinkPlan:
    streams: tuple[int, ...]
    nbytes: int           # total bytes per throughput measurement, split over the streams
    repeats: int
    pings: int            # timed ping-pong round trips
    sockbuf: int | None   # SO_SNDBUF / SO_RCVBUF, None = leave to the OS's autotuning
    timeout: float


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent: UDP connect only picks a route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port or 9))
        return probe.getsockname()[0]


def socket_buffer(requested: int | None, system_max: int | None) -> int | None:
    """A buffer size the kernel will honour; below the cap an explicit size would only shrink it."""
    if not requested:
        return None
    if system_max is not None and requested > system_max:
        return None  # the OS would clamp it below what its autotuning reaches; let it tune
    return requested


def read_rmem_max(path: str = "/proc/sys/net/core/rmem_max") -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # not Linux: macOS caps at kern.ipc.maxsockbuf (8 MB by default), above ours


def _tune(sock: socket.socket, sockbuf: int | None) -> None:
    if sockbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def congestion_control(sock: socket.socket) -> str | None:
    option = getattr(socket, "TCP_CONGESTION", None)  # Linux only
    if option is None:
        return None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, option, 16).split(b"\0")[0].decode() or None
    except OSError:
        return None


def _recv_exact(sock: socket.socket, view: memoryview, nbytes: int) -> None:
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[: min(len(view), nbytes - got)])
        if n == 0:
            raise PeerLostError("raw link peer closed the connection early")
        got += n


def _send_all(sock: socket.socket, chunk: memoryview, nbytes: int) -> None:
    sent = 0
    while sent < nbytes:
        piece = chunk[: min(len(chunk), nbytes - sent)]
        sock.sendall(piece)
        sent += len(piece)


def _in_threads(jobs: Sequence[Callable[[], None]]) -> None:
    """Run jobs in parallel threads; re-raise the first failure after all have finished."""
    errors: list[BaseException] = []

    def guard(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(job,), daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def open_listener(address: str, plan: LinkPlan) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _tune(listener, plan.sockbuf)  # set before listen so accepted sockets scale their window from it
    listener.bind((address, 0))
    listener.listen(max(plan.streams) + 4)
    listener.settimeout(plan.timeout)
    return listener


def _jobs(socks: Sequence[socket.socket], inboxes: Sequence[memoryview], chunk: memoryview | None,
          per_stream: int) -> list[Callable[[], None]]:
    """Receive `per_stream` bytes on every socket, and send as many too when `chunk` is given (duplex)."""
    jobs: list[Callable[[], None]] = [lambda s=s, v=v: _recv_exact(s, v, per_stream) for s, v in zip(socks, inboxes)]
    if chunk is not None:
        jobs += [lambda s=s: _send_all(s, chunk, per_stream) for s in socks]
    return jobs


def serve(listener: socket.socket, plan: LinkPlan) -> None:
    """Rank 1: receive every planned one-way measurement, take part in every duplex one, then answer the
    ping-pong."""
    buffers = [memoryview(bytearray(CHUNK)) for _ in range(max(plan.streams))]
    chunk = memoryview(bytearray(b"\xa5" * CHUNK))
    for duplex in (False, True):
        for streams in plan.streams:
            per_stream = plan.nbytes // streams
            for _ in range(plan.repeats):
                conns = [listener.accept()[0] for _ in range(streams)]
                try:
                    _in_threads(_jobs(conns, buffers, chunk if duplex else None, per_stream))
                    for c in conns:
                        c.sendall(b"k")
                finally:
                    for c in conns:
                        c.close()
    conn = listener.accept()[0]
    with conn:
        view = memoryview(bytearray(PING_BYTES))
        for _ in range(PING_WARMUP + plan.pings):
            _recv_exact(conn, view, PING_BYTES)
            conn.sendall(view)


def _connect(address: str, port: int, plan: LinkPlan) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    _tune(sock, plan.sockbuf)
    sock.settimeout(plan.timeout)
    try:
        sock.connect((address, port))
    except OSError as exc:
        sock.close()
        raise PeerLostError(f"raw link: cannot connect to rank 1 at {address}:{port}: {exc}") from exc
    return sock


def _one_transfer(address: str, port: int, streams: int, plan: LinkPlan, chunk: memoryview,
                  inboxes: Sequence[memoryview] | None = None) -> tuple[float, str | None]:
    """Seconds until rank 1 acknowledged `plan.nbytes` sent over `streams`; with `inboxes`, duplex: rank 1
    sends as much back at the same time, received into those buffers."""
    per_stream = plan.nbytes // streams
    socks = [_connect(address, port, plan) for _ in range(streams)]
    try:
        cc = congestion_control(socks[0])
        start = time.perf_counter()
        jobs = [lambda s=s: _send_all(s, chunk, per_stream) for s in socks]
        if inboxes is not None:
            jobs += _jobs(socks, inboxes, None, per_stream)
        _in_threads(jobs)
        ack = memoryview(bytearray(1))
        for s in socks:
            _recv_exact(s, ack, 1)
        return time.perf_counter() - start, cc
    finally:
        for s in socks:
            s.close()


def measure(address: str, port: int, plan: LinkPlan) -> tuple[list[dict], dict]:
    """Rank 0: throughput records per stream count, and the ping-pong latency record."""
    chunk = memoryview(bytearray(b"\x5a" * CHUNK))
    inboxes = [memoryview(bytearray(CHUNK)) for _ in range(max(plan.streams))]
    records = []
    for streams in plan.streams:
        runs = [_one_transfer(address, port, streams, plan, chunk) for _ in range(plan.repeats)]
        moved = (plan.nbytes // streams) * streams
        rates = summarize([moved / seconds / 1e9 for seconds, _ in runs])
        records.append({"streams": streams, "bytes": moved, "gbps": rates.median, "gbps_min": rates.minimum,
                        "gbps_max": rates.maximum, "time_us": moved / rates.median / 1e3,
                        "congestion_control": runs[0][1]})
    for rec in records:  # the same order as serve(): every one-way measurement first, then the duplex ones
        runs = [_one_transfer(address, port, rec["streams"], plan, chunk, inboxes) for _ in range(plan.repeats)]
        rates = summarize([rec["bytes"] / seconds / 1e9 for seconds, _ in runs])
        rec.update(duplex_gbps=rates.median, duplex_gbps_min=rates.minimum, duplex_gbps_max=rates.maximum)
    return records, _pingpong(address, port, plan)


def _pingpong(address: str, port: int, plan: LinkPlan) -> dict:
    rtts = []
    with _connect(address, port, plan) as sock:
        view = memoryview(bytearray(PING_BYTES))
        for i in range(PING_WARMUP + plan.pings):
            start = time.perf_counter_ns()
            sock.sendall(view)
            _recv_exact(sock, view, PING_BYTES)
            if i >= PING_WARMUP:
                rtts.append((time.perf_counter_ns() - start) / 2e3)
    ordered = sorted(rtts)
    return {"bytes": PING_BYTES, "iters": len(rtts), "latency_us": percentile(ordered, 50),
            "latency_us_p10": percentile(ordered, 10), "latency_us_p90": percentile(ordered, 90),
            "latency_us_min": ordered[0], "latency_us_max": ordered[-1]}


def run(rank: int, plan: LinkPlan, master: tuple[str, int], share: Callable[[object], object]) -> tuple[list[dict], dict, str] | None:
    """All ranks call this; `share(obj)` broadcasts rank 1's object to every rank (a collective).

    Returns (throughput records, latency record, address) on rank 0, None elsewhere.
    """
    listener = None
    offer: object = None
    if rank == 1:
        try:
            listener = open_listener(local_address_towards(*master), plan)
            offer = listener.getsockname()[:2]
        except OSError as exc:
            offer = f"rank 1 cannot listen for the raw link test: {exc}"
    offer = share(offer)  # every rank takes part, even when rank 1 failed, so nobody hangs
    try:
        if isinstance(offer, str):
            raise ThunderboltError(offer)
        address, port = offer  # type: ignore[misc]
        if rank == 1:
            serve(listener, plan)  # type: ignore[arg-type]
        elif rank == 0:
            records, latency = measure(address, port, plan)
            return records, latency, address
        return None
    except socket.timeout as exc:
        raise ThunderboltError(f"raw link test timed out after {plan.timeout:.0f} s") from exc
    finally:
        if listener is not None:
            listener.close()
