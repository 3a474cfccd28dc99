"""Real TCP transports for N ranks inside this process (threads + a TCPStore): for tests that need to act on
one rank's sockets directly (forge frames, stall one side) without spawning processes."""
from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Iterator

import torch.distributed as dist

from torch_thunderbolt.config import Config
from torch_thunderbolt.rendezvous.tcp import connect_tcp
from torch_thunderbolt.transport.engine import Transport


@contextlib.contextmanager
def tcp_world(world: int, cfg: Config | None = None, timeout: float = 30.0) -> Iterator[list[Transport]]:
    cfg = cfg or Config(streams=1)
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout),
                           wait_for_workers=False)
    transports: list[Transport | None] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            st = dist.TCPStore("127.0.0.1", server.port, world, False, timeout=datetime.timedelta(seconds=timeout))
            transports[r] = connect_tcp(dist.PrefixStore("job/", st), r, world, cfg, timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    try:
        if errors:
            raise errors[0]
        assert all(t is not None for t in transports), "a rank did not connect"
        yield transports  # type: ignore[misc]
    finally:
        for t in transports:
            if t is not None:
                t.close()
