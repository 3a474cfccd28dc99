"""Exceptions, named by whose fault the failure is.

Every exception raised by torch-thunderbolt derives from `ThunderboltError`. OS errors are translated into
these in one place (`translate_os_error`) so callers never have to catch raw `OSError`s.
"""
from __future__ import annotations


class ThunderboltError(RuntimeError):
    """Base class of everything torch-thunderbolt raises."""


class ConfigError(ThunderboltError, ValueError):
    """The user's configuration (environment variables, arguments, hostfile) is wrong."""


class ProtocolError(ThunderboltError):
    """A peer sent bytes that do not follow the wire protocol (or is not one of ours)."""


class HandshakeError(ProtocolError):
    """A connection failed the handshake (wrong magic, version, secret, rank or group), a set-up record in
    the rendezvous store failed its check, or a connection was relayed. `why` says which kind of failure it
    is where the set-up words its message after it: "mac" (the peer proved no key, or another one: most
    likely another THUNDERBOLT_SECRET), "relay" (the addresses each end used differ: someone in the middle),
    "store" (a record failed its MAC: the store was tampered with), "" (anything else)."""

    def __init__(self, message: str = "", *, why: str = "") -> None:
        super().__init__(message)
        self.why = why


class IntegrityError(ProtocolError):
    """With THUNDERBOLT_INTEGRITY=mac, a frame failed its MAC: it was altered, replayed, reordered or dropped
    on the way (or the peer is not one of ours)."""


class MismatchError(ThunderboltError):
    """Ranks called different collectives, or the same one with different sizes/dtypes/roots."""


class PeerLostError(ThunderboltError, ConnectionError):
    """The connection to a peer broke (it died, or the cable went away). `__cause__` is the OS error."""

    def __init__(self, message: str, *, rank: int = -1, peer: int = -1, address: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.address = address


def peer_lost(rank: int, peer: int, what: str, *, cause: "BaseException | None" = None, address: str = "",
              hint: str = "") -> PeerLostError:
    """The user's error for a peer that is gone or cannot be reached, built here and nowhere else: "rank
    `rank`: `what`" (what this rank expected of `peer` and did not get), then the OS error `cause` (also
    its `__cause__`), then `hint` (what to do next). `address`: where the peer was, for tools."""
    text = f"rank {rank}: {what}"
    if cause is not None:
        text += f": {cause}"
    if hint:
        text += f"; {hint}"
    err = PeerLostError(text, rank=rank, peer=peer, address=address)
    if cause is not None:
        err.__cause__ = cause
    return err


def peer_shut_down(rank: int, peer: int, expected: str, *, address: str = "") -> PeerLostError:
    """`peer` ended its process group in order (its BYE) while this rank still expected `expected` of it
    (a send it would take, data it would send)."""
    return peer_lost(rank, peer, f"rank {peer} has shut down its process group, but this rank still expected "
                     f"{expected}", address=address,
                     hint=f"rank {peer} ran fewer collectives or sends than this rank: every rank must run the "
                     f"same ones before destroy_process_group")


class CollectiveTimeout(ThunderboltError, TimeoutError):
    """A collective did not finish within the group's timeout. The message contains "Timed out".
    `ranks`: the ranks it blames (that never arrived or stopped sending), when it could tell."""

    def __init__(self, message: str = "", *, ranks: "list[int] | tuple[int, ...]" = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class BackendClosedError(ThunderboltError):
    """The process group was destroyed or shut down; no further operations are possible."""


class PeerAbortedError(ThunderboltError):
    """A peer failed (for a reason of its own) and told us before closing its connections."""

    peer: int = -1


class RdmaError(ThunderboltError):
    """A verbs call failed (the RDMA device, its driver or the machine's set-up), or an RDMA path carries
    nothing. `call` is the ibverbs function ("" for a path or a peer's failure), `device` the RDMA device
    (e.g. rdma_en2), `errno` the OS error, `rank` the rank whose device or path failed where that is not the
    one raising it (a peer that gave up its RDMA set-up; -1: this one); the message says what to do. Every
    errno is translated in transport/verbs.py."""

    def __init__(self, message: str, *, call: str = "", device: str = "", errno: int = 0, rank: int = -1) -> None:
        super().__init__(message)
        self.call = call
        self.device = device
        self.errno = errno
        self.rank = rank
