"""Ranks as threads of this process: the fast test tier, and the way to reach into one rank's transport.

- `memory_world`: one function per rank over the in-memory transport (transport.memory.MemoryHub).
- `tcp_world`: real TCP transports between threads (a TCPStore on loopback), for tests that act on one
  rank's sockets directly (forge frames, stall one side) without spawning processes.
- `rdma_world`: RDMA transports between threads over a fake verbs fabric (testing.fake_verbs), rank r on
  the fabric's r-th device, for tests that inject faults or reach into one rank's queue pairs.
- `tcp_pair`: two TCP transports over loopback streams this process connects itself (one per source
  address: several cables), optionally sealed and on the darwin socket model, for tests that cut,
  stall or fail one stream.
- `exchange_world`: threads swapping tensors through shared slots, for code that takes an `exchange=`
  (the compression pipeline) and must be tested without any transport.
- `SetUpOnThreads`: ranks started one at a time as threads, each running a set-up over one TCPStore, for
  tests that play a stranger on the store (rewrite a record, relay an endpoint) between them.
- `all_reduce_on_threads`: one all_reduce per rank of an already-connected group.

Every helper joins its threads against a deadline, so a hung rank fails the test instead of hanging it.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config
    from torch_thunderbolt.transport.engine import Transport

T = TypeVar("T")


@dataclass
class ThreadRun:
    """How the rank threads of one world ended."""
    results: list[Any]
    errors: dict[int, BaseException] = field(default_factory=dict)  # rank -> error, in the order raised
    hung: list[int] = field(default_factory=list)  # ranks still running at the deadline

    def first_error_by_rank(self) -> BaseException | None:
        return self.errors[min(self.errors)] if self.errors else None

    def first_error_raised(self) -> BaseException | None:
        return next(iter(self.errors.values()), None)


def on_threads(world: int, body: Callable[[int], Any], timeout: float,
               on_error: Callable[[int], None] | None = None) -> ThreadRun:
    """body(rank) on `world` daemon threads, joined until `timeout` seconds from now. `on_error(rank)` runs
    in the failing thread right after its error, so that the others stop waiting for it."""
    run = ThreadRun([None] * world)
    lock = threading.Lock()

    def thread(rank: int) -> None:
        try:
            run.results[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            with lock:
                run.errors[rank] = exc
            if on_error is not None:
                on_error(rank)

    threads = [threading.Thread(target=thread, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    run.hung = [r for r, t in enumerate(threads) if t.is_alive()]
    return run


def memory_world(world: int, fn: Callable[[Communicator], T], cfg: Config | None = None,
                 timeout: float = 60.0, comm_timeout: float = 30.0, window_bytes: int = 0) -> list[T]:
    """fn(comm) on every rank over one MemoryHub; returns the per-rank results or re-raises the error of the
    lowest failing rank (a rank that fails is killed on the hub, so its peers see it lost, as in a job).
    `window_bytes` > 0: the ranks share a window, so all_reduce and broadcast take the windowed path."""
    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config
    from torch_thunderbolt.transport.memory import MemoryHub

    hub = MemoryHub(world, window_bytes)
    cfg = cfg or Config()
    run = on_threads(world, lambda r: fn(Communicator(hub.transports[r], cfg, timeout=comm_timeout)), timeout,
                     on_error=hub.kill)
    if run.hung:
        raise TimeoutError("a rank thread hung")
    first = run.first_error_by_rank()
    if first is not None:
        raise first
    return run.results


@contextlib.contextmanager
def tcp_world(world: int, cfg: Config | None = None, timeout: float = 30.0) -> Iterator[list[Transport]]:
    """`world` connected TCP transports (one thread each connected them), closed when the block ends."""
    from torch_thunderbolt.config import Config
    from torch_thunderbolt.rendezvous.tcp import connect_tcp

    cfg = cfg or Config(streams=1)
    with _threads_connected(world, lambda store, r: connect_tcp(store, r, world, cfg, timeout), timeout) as ts:
        yield ts


@contextlib.contextmanager
def rdma_world(world: int, fabric: Any, cfg: Config | None = None, timeout: float = 30.0) -> Iterator[list[Transport]]:
    """`world` connected RDMA transports over the fake fabric `fabric` (a testing.fake_verbs.Fabric, or its
    directory), one thread each, closed when the block ends. `cfg`: settings besides the fabric."""
    import dataclasses

    from torch_thunderbolt.config import Config
    from torch_thunderbolt.rendezvous.rdma import connect_rdma

    path = str(getattr(fabric, "path", fabric))
    cfg = dataclasses.replace(cfg or Config(), verbs="fake", verbs_fabric=path, transport="rdma")
    with _threads_connected(world, lambda store, r: connect_rdma(store, r, world, cfg, timeout), timeout) as ts:
        yield ts


def tcp_pair(sources: Sequence[str] = ("127.0.0.1", "127.0.0.2"), *, sealed: bool = False,
             darwin: Any = None, **options: Any) -> "tuple[Transport, Transport]":
    """Transports of ranks 0 and 1 joined by one loopback stream per source address (TCP_NODELAY). `sealed`:
    every frame carries a MAC (THUNDERBOLT_INTEGRITY=mac); `darwin`: a `testing.darwin.Xnu` whose sockets
    they use, under the darwin platform. `options` go to tcp_transport (stripe_bytes=...)."""
    import os
    import socket

    from torch_thunderbolt.protocol.integrity import stream_keys
    from torch_thunderbolt.transport.tcp import tcp_transport

    client: list[Any] = []
    server: list[Any] = []
    with socket.create_server(("127.0.0.1", 0)) as lst:
        port = lst.getsockname()[1]
        for src in sources:
            c = socket.create_connection(("127.0.0.1", port), source_address=(src, 0))
            s, _ = lst.accept()
            for x in (c, s):
                x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.append(c)
            server.append(s)
    if darwin is not None:
        from torch_thunderbolt.testing.darwin import DARWIN

        client, server = [darwin.wrap(x) for x in client], [darwin.wrap(x) for x in server]
        options = {**options, "plat": DARWIN}
    sessions = [os.urandom(32) for _ in sources]
    seal = [(r, {1 - r: [stream_keys(k, r, 1 - r) for k in sessions]}) if sealed else None for r in (0, 1)]
    return (tcp_transport(0, 2, {1: server}, seal=seal[0], **options),
            tcp_transport(1, 2, {0: client}, seal=seal[1], **options))


@contextlib.contextmanager
def _threads_connected(world: int, connect_rank: "Callable[[Any, int], Transport]",
                       timeout: float) -> Iterator[list[Transport]]:
    """connect_rank(store, rank) on `world` threads around one TCPStore on loopback; the transports are
    closed when the block ends."""
    server = _store_server(world, timeout)

    def connect(r: int) -> Transport:
        return connect_rank(_rank_store(server.port, world, timeout), r)

    run = on_threads(world, connect, timeout + 5)
    transports: list[Transport | None] = [t if r not in run.hung else None for r, t in enumerate(run.results)]
    try:
        first = run.first_error_raised()
        if first is not None:
            raise first
        assert all(t is not None for t in transports), "a rank did not connect"
        yield transports  # type: ignore[misc]
    finally:
        for t in transports:
            if t is not None:
                t.close()


def _store_server(world: int, timeout: float) -> Any:
    """The TCPStore server of one world on loopback (a free port); it does not wait for the ranks."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def _rank_store(port: int, world: int, timeout: float) -> Any:
    """A rank's own client of the store server at `port`, under the "job/" prefix a job's ranks use."""
    import torch.distributed as dist

    st = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore("job/", st)


class SetUpOnThreads:
    """Ranks started one at a time as threads, each running a set-up (`connect(store, rank, world, cfg,
    timeout)`: rendezvous.tcp.connect_tcp, rendezvous.group.connect ...) over one TCPStore on loopback, so
    that a test can play a stranger on the store between them: `view` is the store as anyone reading
    MASTER_PORT sees it. What each rank's set-up returned is in `results`, what it raised in `errors`;
    `close_result` closes one result when the world closes (as a `with` block ends: after joining)."""

    def __init__(self, world: int, connect: Callable[..., Any], close_result: Callable[[Any], None] | None = None,
                 timeout: float = 30.0) -> None:
        import torch.distributed as dist

        self.world, self.timeout = world, timeout
        self._connect = connect
        self._close_result = close_result or (lambda t: t.close())
        self.server = _store_server(world, timeout)
        self.view = dist.PrefixStore("job/", self.server)
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.threads: list[threading.Thread] = []

    def start(self, rank: int, cfg: Config, wrap_store: Callable[[Any], Any] | None = None) -> None:
        """Rank `rank`'s set-up with `cfg` on a thread of its own; `wrap_store` gives the store it sees
        (a stranger's rewriting view, say) from its own client of the server."""
        def run() -> None:
            try:
                store = _rank_store(self.server.port, self.world, self.timeout)
                store = wrap_store(store) if wrap_store is not None else store
                self.results[rank] = self._connect(store, rank, self.world, cfg, self.timeout)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                self.errors[rank] = exc
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 60.0) -> None:
        """Waits for every rank started so far; a rank still in its set-up after `timeout` fails the test."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a rank hung in the set-up"

    def __enter__(self) -> "SetUpOnThreads":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.join()
        finally:
            self.close()

    def close(self) -> None:
        for result in self.results.values():
            self._close_result(result)
        # The errors' tracebacks hold the ranks' frames and with them this object: drop the store server
        # now, not at some later garbage collection (the session checks that nothing still listens).
        self.errors.clear()
        self.server = self.view = None
        gc.collect()


def all_reduce_on_threads(transports: Mapping[int, Transport] | Sequence[Transport],
                          make: Callable[[int], torch.Tensor], timeout: float = 30.0) -> dict[int, torch.Tensor]:
    """One all_reduce of make(rank) on each transport of an already-connected group, one thread per rank;
    returns {rank: result} for the ranks that finished within `timeout` (a test asserts which did)."""
    from torch_thunderbolt.algorithms.collectives import Communicator
    from torch_thunderbolt.config import Config

    ranks = sorted(transports) if isinstance(transports, Mapping) else list(range(len(transports)))
    results: dict[int, torch.Tensor] = {}

    def body(i: int) -> None:
        r = ranks[i]
        x = make(r)
        Communicator(transports[r], Config(), timeout=20).all_reduce(x)
        results[r] = x

    on_threads(len(ranks), body, timeout)
    return results


class ThreadExchange:
    """The exchange of one thread-rank in `exchange_world`: all_to_all and all_gather of rows of a tensor
    through slots every rank can read, with a barrier around each exchange."""

    def __init__(self, rank: int, world_size: int, slots: list[Any], barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self._slots, self._barrier = rank, world_size, slots, barrier

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._slots[self.rank] = inp.clone()
        self._barrier.wait()
        for src in range(self.world_size):
            out[src] = self._slots[src][self.rank]
        self._barrier.wait()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._slots[self.rank] = inp.clone()
        self._barrier.wait()
        for src in range(self.world_size):
            out[src] = self._slots[src][0]
        self._barrier.wait()


def exchange_world(world_size: int, fn: Callable[[ThreadExchange], T], timeout: float = 20.0) -> list[T]:
    """fn(exchange) on `world_size` threads; returns results by rank, or re-raises the first error raised
    (a failing rank breaks the barrier, so the others stop at once with BrokenBarrierError)."""
    slots: list[Any] = [None] * world_size
    barrier = threading.Barrier(world_size, timeout=timeout)
    run = on_threads(world_size, lambda r: fn(ThreadExchange(r, world_size, slots, barrier)), timeout,
                     on_error=lambda r: barrier.abort())
    first = run.first_error_raised()
    if first is not None:
        raise first
    assert not run.hung, "thread ranks hung"
    return run.results
