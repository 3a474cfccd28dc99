"""The set-up file of the `sock` kind (see sock_link.py): Unix stream sockets between the ranks of a host.

Each rank listens on a fresh path, publishes it as a set-up record (`setup.records`: checked with the job's
key, like every record), connects to every lower peer and accepts every higher one; a connection opens with
the connecting rank and a token the kind's leader published (so a stranger's connection is refused); once
every rank has its sockets, the paths are removed.
"""
from __future__ import annotations

import os
import secrets
import socket
import struct
import tempfile
import time

from ...errors import HandshakeError, peer_lost
from ...config import Config
from ...rendezvous.hosts import recv_exact
from ...rendezvous.setup import SetUp
from .sock_link import SockLinks

_HELLO = struct.Struct("<I16s")  # the connecting rank, the token


def offer(cfg: Config) -> str | None:
    return None if hasattr(socket, "AF_UNIX") else "this system has no Unix sockets"


def connect_sock_links(setup: SetUp) -> SockLinks:
    records, rank = setup.records, setup.rank
    deadline = time.monotonic() + min(setup.timeout, setup.cfg.connect_timeout)
    if rank == setup.leader:
        token_hex = secrets.token_hex(16)
        records.publish("sock/token", token_hex)
    else:
        token_hex = records.read("sock/token", setup.leader, "the sock links' token")
    token = bytes.fromhex(token_hex)
    path = os.path.join(tempfile.gettempdir(), f"tb-sock-{secrets.token_hex(6)}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socks: dict[int, socket.socket] = {}
    try:
        listener.bind(path)
        listener.listen(len(setup.peers) + 1)
        records.publish(f"sock/path/{rank}", path)
        for p in (p for p in setup.peers if p < rank):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks[p] = s
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect(records.read(f"sock/path/{p}", p, "its socket's path"))
            s.sendall(_HELLO.pack(rank, token))
        higher = {p for p in setup.peers if p > rank}
        while higher:
            listener.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                s, _ = listener.accept()
            except socket.timeout:
                raise peer_lost(rank, min(higher), f"ranks {sorted(higher)} never connected to this rank's "
                                f"socket within the set-up's deadline: did they start?") from None
            s.settimeout(max(0.1, deadline - time.monotonic()))
            who, theirs = _HELLO.unpack(recv_exact(s, _HELLO.size))
            if theirs != token or who not in higher:
                s.close()
                raise HandshakeError(f"rank {rank}: a sock connection claiming rank {who} was refused")
            socks[who] = s
            higher.discard(who)
        records.publish(f"sock/ready/{rank}", 1)
        for p in setup.peers:
            records.read(f"sock/ready/{p}", p, "its readiness")
        return SockLinks(socks)
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
