"""Strangers at a rank's door: refused and logged, the job unaffected; nothing listens after setup."""
from __future__ import annotations

import datetime
import logging
import os
import socket
import struct
import threading

import pytest
import torch
import torch.distributed as dist

from torch_thunderbolt.config import Config
from torch_thunderbolt.protocol import handshake as hs
from torch_thunderbolt.rendezvous.records import unchecked_value
from torch_thunderbolt.rendezvous.tcp import connect_tcp, group_key
from torch_thunderbolt.testing.worlds import all_reduce_on_threads

pytestmark = pytest.mark.timeout(60)


def _hello(sock: socket.socket, rank: int, secret: bytes, group: str, version: int = hs.VERSION) -> bytes:
    challenge = sock.recv(hs.CHALLENGE_SIZE)
    client = hs.ClientHandshake(secret, rank, 0, 0, group)
    hello = bytearray(client.receive_challenge(challenge))
    hello[6:8] = struct.pack("<H", version)
    sock.sendall(hello)
    return sock.recv(hs.REPLY_SIZE)


def test_hostile_connections_are_refused_and_the_job_runs(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="torch_thunderbolt.bootstrap")
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    transports: dict[int, object] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            st = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=30))
            transports[r] = connect_tcp(dist.PrefixStore("job/", st), r, 2, Config(streams=2), 30)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t0 = threading.Thread(target=rank, args=(0,))
    t0.start()
    view = dist.PrefixStore("job/", server)
    view.wait(["tb/ep/0"])
    ep = tuple(unchecked_value(view.get("tb/ep/0"))["endpoints"][0])
    secret, group = group_key(view, 1, b"")  # no THUNDERBOLT_SECRET here: the store's nonce is the key

    def attempt(action) -> None:
        with socket.create_connection(ep, timeout=5) as s:
            try:
                action(s)
                s.shutdown(socket.SHUT_WR)  # hang up: the rank must not wait for more
                while s.recv(100):
                    pass
            except OSError:
                pass

    attempt(lambda s: s.sendall(os.urandom(200)))  # random bytes
    attempt(lambda s: s.sendall(b"\x00" * 7))  # truncated, then hang up
    attempt(lambda s: _hello(s, 1, b"wrong" * 7, group))  # wrong secret
    attempt(lambda s: _hello(s, 1, secret, group, version=7))  # wrong protocol version
    attempt(lambda s: _hello(s, 5, secret, group))  # a rank that does not exist
    attempt(lambda s: s.sendall(b"\xff" * hs.HELLO_SIZE))  # absurd fields
    t1 = threading.Thread(target=rank, args=(1,))
    t1.start()
    t0.join(40)
    t1.join(40)
    assert not errors, errors
    refused = [r.message for r in caplog.records if "refused" in r.message]
    assert len(refused) >= 5, refused

    results = all_reduce_on_threads(transports, lambda r: torch.full((1000,), float(r + 1)))
    assert set(results) == {0, 1}
    assert all(torch.equal(results[r], torch.full((1000,), 3.0)) for r in (0, 1))
    # listeners are closed once the group is connected: later strangers are refused by the kernel
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(ep, timeout=5)
    for t in transports.values():
        t.close()
