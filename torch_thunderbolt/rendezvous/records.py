"""Set-up records in the rendezvous store, authenticated with the job's key.

torch's TCPStore has no authentication: anyone who reaches MASTER_PORT can read and rewrite what the ranks
publish there. Every record the set-up trusts (the group's nonce, each rank's endpoints, host identity,
shared-memory set-up, a rank's failure, how its set-up of a kind of link ended) is therefore written and
read through `Records`: with THUNDERBOLT_SECRET, each record carries a MAC over the group it belongs to, its
name and its value, with a key derived from the secret, so a record rewritten by someone without the secret
fails with a `HandshakeError` that names it, on the rank that reads it; the rank then announces its failure
(itself a record) and every rank waiting on it raises it too, within the set-up deadline. A rank can also give up one
kind of link alone (`give_up`: RDMA whose device or path fails): the ranks waiting for it in that kind's
set-up raise that at once, while the group's set-up goes on (under THUNDERBOLT_TRANSPORT=auto it joins
those pairs with another kind: group.py).

Without a secret there is nothing to authenticate with (the handshake key itself sits in the store), so
records carry no MAC and are taken as they are; each rank with TCP peers warns (rendezvous/tcp.py).

A record is JSON: {"value": <the value's JSON text>, "key": <key id>, "mac": <MAC>}. The key id (a hash of
the record key) tells "written with another secret" (most likely a misconfigured rank: the hint about
THUNDERBOLT_SECRET) from "rewritten" (the key id is ours but the MAC is wrong: tampering); a stranger can
forge neither a MAC nor, usefully, a key id. The MAC is bound to the group id once it is known, so a record
of another group or job (with the same secret) cannot be replayed into this one.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import ConfigError, HandshakeError, RdmaError, ThunderboltError, peer_lost
from ..protocol import handshake as hs

SECRET_HINT = ("every rank of the job needs the same THUNDERBOLT_SECRET (`torch-thunderbolt launch` gives all "
               "ranks of a job the same one)")
GROUP = "tb/group"  # rank 0's fresh nonce and group id
_LABEL = b"torch-thunderbolt set-up records v1"
_POLL_FIRST, _POLL_MAX = 0.001, 0.05  # seconds between looks at the store while a record is missing


def failed_name(rank: int) -> str:
    return f"tb/failed/{rank}"


def kind_name(kind: str, rank: int) -> str:
    """The record of how `rank`'s set-up of links of `kind` ended (kinds that may give way under auto)."""
    return f"tb/kind/{kind}/{rank}"


@dataclass(frozen=True)
class GaveUp:
    """One rank's giving up its set-up of one kind of link, for a reason of the kind's own (`Records.give_up`)."""

    rank: int  # the rank that gave up
    origin: int  # the rank whose device or path failed: this one, or the peer it learned it from
    error: str  # the error's type ("RdmaError")
    device: str  # the device that failed, where known ("" otherwise)
    message: str

    @property
    def first_hand(self) -> bool:
        return self.origin == self.rank


@dataclass(frozen=True)
class GroupAuth:
    """What the handshake of one group needs: its key and id (see `Records.join_group`)."""

    key: bytes
    group_id: str


def unchecked_value(raw: "bytes | str") -> Any:
    """The value a record holds, unchecked: what anyone who reads the store sees (tests, debugging)."""
    return json.loads(json.loads(raw)["value"])


class Records:
    """This rank's view of the set-up records of one group in `store`. `secret`: THUNDERBOLT_SECRET (b"":
    none, records are neither signed nor checked). `deadline` (time.monotonic()): how long `read` waits for
    a record that is not there yet. Not thread-safe for writes; reads from an accept thread are fine."""

    def __init__(self, store: Any, rank: int, secret: bytes, deadline: float) -> None:
        self.store, self.rank, self.deadline = store, rank, deadline
        self._secret = secret
        self._key = hmac.new(secret, _LABEL, hashlib.sha256).digest() if secret else b""
        self.key_id = hmac.new(self._key, b"key id", hashlib.sha256).hexdigest()[:16] if secret else ""
        self.scope = ""  # the group id once known (join_group): bound into every later record's MAC
        self._verified: set[int] = set()  # ranks a signed record of which checked out
        self.announced = False
        self._given_up: set[str] = set()  # the kinds of link this rank gave up (give_up)

    @property
    def signed(self) -> bool:
        return bool(self._key)

    def _mac(self, scope: str, name: str, text: str) -> str:
        return hmac.new(self._key, b"\x00".join((scope.encode(), name.encode(), text.encode())),
                        hashlib.sha256).hexdigest()

    def encode(self, name: str, value: Any, scope: "str | None" = None) -> str:
        """The stored text of record `name` holding `value` (anything json can write)."""
        text = json.dumps(value)
        if not self._key:
            return json.dumps({"value": text})
        scope = self.scope if scope is None else scope
        return json.dumps({"value": text, "key": self.key_id, "mac": self._mac(scope, name, text)})

    def publish(self, name: str, value: Any, scope: "str | None" = None) -> None:
        self.store.set(name, self.encode(name, value, scope))

    def decode(self, name: str, raw: "bytes | str", owner: int, scope: "str | None" = None) -> Any:
        """The value of record `name` (published by rank `owner`), checked; HandshakeError when it was
        tampered with or signed with another key, ConfigError when one side has no secret."""
        me = self.rank
        unreadable = HandshakeError(
            f"rank {me}: record {name} in the rendezvous store (published as rank {owner}'s) is not a set-up "
            f"record of this torch-thunderbolt version: rank {owner} runs another version, or the store was "
            f"tampered with", why="store")
        try:
            rec = json.loads(raw)
            text = rec["value"]
            key_id, mac = rec.get("key", ""), rec.get("mac", "")
            if not isinstance(text, str) or not isinstance(key_id, str) or not isinstance(mac, str):
                raise TypeError("fields")
            value = json.loads(text)
        except (ValueError, TypeError, KeyError, AttributeError):
            raise unreadable from None
        if not self._key:
            if key_id or mac:
                raise ConfigError(f"rank {me}: rank {owner} has THUNDERBOLT_SECRET set but this rank has none "
                                  f"(record {name}); {SECRET_HINT}")
            return value
        if not mac:
            if owner in self._verified:
                raise HandshakeError(
                    f"rank {me}: the rendezvous store was tampered with: record {name} carries no MAC, though "
                    f"rank {owner}'s other records do; {_TAMPERED}", why="store")
            raise ConfigError(f"rank {me}: rank {owner} published record {name} without a MAC: rank {owner} has "
                              f"no THUNDERBOLT_SECRET but this rank has one (or someone without the secret "
                              f"rewrote that record in the rendezvous store); {SECRET_HINT}")
        if key_id != self.key_id:
            raise HandshakeError(
                f"rank {me}: rank {owner}'s record {name} is signed with another key than this rank's: rank "
                f"{owner} has another THUNDERBOLT_SECRET (or someone without the secret rewrote the record); "
                f"{SECRET_HINT}", why="mac")
        scope = self.scope if scope is None else scope
        if not hmac.compare_digest(mac, self._mac(scope, name, text)):
            raise HandshakeError(
                f"rank {me}: the rendezvous store was tampered with: record {name} (published as rank {owner}'s) "
                f"does not carry a valid MAC for this job's key{' and group' if scope else ''}; {_TAMPERED}",
                why="store")
        self._verified.add(owner)
        return value

    def peek(self, name: str, owner: int, scope: "str | None" = None) -> Any:
        """The checked value of record `name` if it is there, else None (no waiting)."""
        if not self.store.check([name]):
            return None
        return self.decode(name, self.store.get(name), owner, scope)

    def read(self, name: str, owner: int, what: str = "", kind: str = "") -> Any:
        """The checked value of record `name`, published by rank `owner`, waiting for it until the deadline.
        If `owner` announced a failure meanwhile, its failure is raised here (so a rank that gave up during
        set-up is named at once on every rank waiting for it, with its reason); with `kind` (a record of
        that kind's set-up), also its giving up that kind alone (`give_up`)."""
        wait = _POLL_FIRST
        while True:
            if self.store.check([name]):
                return self.decode(name, self.store.get(name), owner)
            failed = self.failure(owner, kind)
            if failed is not None:
                raise failed
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise peer_lost(self.rank, owner, f"timed out waiting for rank {owner} to publish "
                                f"{what or 'record'} {name} in the rendezvous store: did rank {owner} start? "
                                f"(THUNDERBOLT_CONNECT_TIMEOUT)")
            time.sleep(min(wait, left))
            wait = min(wait * 2, _POLL_MAX)

    # -- failures ---------------------------------------------------------------------------------------
    def announce(self, exc: BaseException) -> None:
        """Tell the other ranks why this rank gives up the set-up (once; the first reason is the real one).
        Best effort: the store itself may be what failed."""
        if self.announced:
            return
        self.announced = True
        value = {"error": type(exc).__name__, "why": getattr(exc, "why", ""), "message": str(exc)[:2000],
                 "group": self.scope}
        try:
            self.publish(failed_name(self.rank), value, scope="")
        except Exception:  # noqa: BLE001
            pass

    def raise_failure(self, owners: "Iterable[int]", kind: str = "") -> None:
        """Raise the failure (`failure`) of the first of `owners` that announced one (with `kind`: or gave
        up that kind); return when none did. For a rank waiting on several peers at once."""
        for owner in owners:
            failed = self.failure(owner, kind)
            if failed is not None:
                raise failed

    def failure(self, owner: int, kind: str = "") -> "ThunderboltError | None":
        """What to raise here if rank `owner` announced that it gave up the set-up (None if it did not); with
        `kind`, also if it gave up setting up links of that kind (`give_up`): that reason first, since it
        was published first and the group's failure, where one follows, only repeats it."""
        unchecked: ThunderboltError | None = None
        if kind:
            try:
                failed = self._kind_failure(owner, kind)
            except ThunderboltError as exc:  # its record failed its check: the group's failure says why, if any
                unchecked = exc
            else:
                if failed is not None:
                    return failed
        failed = self._group_failure(owner)
        return failed if failed is not None else unchecked

    def _kind_failure(self, owner: int, kind: str) -> "ThunderboltError | None":
        """What to raise here if rank `owner` gave up setting up links of `kind` (`give_up`); raises the
        ThunderboltError of a record that fails its check."""
        try:
            gave_up = self.outcome(kind, owner, wait=False)
        except ThunderboltError:
            raise
        except Exception:  # noqa: BLE001 - the store may be gone: the caller raises what it has
            return None
        if gave_up is None:
            return None
        what = f"rank {owner} gave up setting up {kind} links: {gave_up.message}"
        if gave_up.error == "RdmaError":  # still RDMA's fault: the device, and the rank whose device it is
            return RdmaError(f"rank {self.rank}: {what}", device=gave_up.device, rank=gave_up.origin)
        return peer_lost(self.rank, owner, what)

    def _group_failure(self, owner: int) -> "ThunderboltError | None":
        """What to raise here if rank `owner` announced that it gave up the set-up (`announce`)."""
        name = failed_name(owner)
        try:
            if not self.store.check([name]):
                return None
            info = self.decode(name, self.store.get(name), owner, scope="")
        except HandshakeError as exc:
            if exc.why == "mac":  # signed with another key: that rank has another secret
                return HandshakeError(
                    f"rank {self.rank}: rank {owner} failed its handshake: its failure record {name} is signed "
                    f"with another key than this rank's: rank {owner} has another THUNDERBOLT_SECRET (or "
                    f"someone without the secret wrote that record); {SECRET_HINT}", why="mac")
            return exc
        except ConfigError as exc:
            return exc
        except Exception:  # noqa: BLE001 - the store may be gone: the caller raises what it has
            return None
        if not isinstance(info, dict) or info.get("group") not in ("", self.scope, None):
            return None  # another group's (a replay): not ours to report
        name_, why, message = str(info.get("error", "")), str(info.get("why", "")), str(info.get("message", ""))
        verb = "failed its handshake" if why == "mac" else "gave up during set-up"
        what = f"rank {owner} {verb}: {name_}: {message}"
        text = f"rank {self.rank}: {what}"
        if name_ == "ConfigError":
            return ConfigError(text)
        if name_ in ("HandshakeError", "ProtocolError", "IntegrityError"):
            return HandshakeError(text, why=why)
        return peer_lost(self.rank, owner, what)

    # -- one kind of link given up -------------------------------------------------------------------------
    def give_up(self, kind: str, exc: BaseException) -> None:
        """Tell the other ranks that this rank gave up setting up links of `kind` for a reason of the kind's
        own (`exc`: its device, driver or path failed), the group's set-up going on: the ranks waiting for
        this one in that set-up (`read`/`failure` with `kind`) raise it at once. Published before the set-up
        closes what its peers wait on (its sockets), so that a peer finding them closed reads why. Once per
        kind; best effort, as `announce`."""
        if kind in self._given_up:
            return
        self._given_up.add(kind)
        origin = getattr(exc, "rank", -1)
        value = {"made": False, "error": type(exc).__name__, "device": str(getattr(exc, "device", "") or ""),
                 "origin": origin if isinstance(origin, int) and origin >= 0 else self.rank,
                 "message": str(exc)[:2000]}
        try:
            self.publish(kind_name(kind, self.rank), value)
        except Exception:  # noqa: BLE001
            pass

    def gave_up(self, kind: str) -> bool:
        """Whether this rank gave up setting up links of `kind` (`give_up`)."""
        return kind in self._given_up

    def made(self, kind: str) -> None:
        """Tell the other ranks that this rank's set-up of links of `kind` succeeded."""
        self.publish(kind_name(kind, self.rank), {"made": True})

    def outcome(self, kind: str, owner: int, wait: bool = True) -> "GaveUp | None":
        """How rank `owner`'s set-up of links of `kind` ended: None when it made them, else its giving up.
        `wait`: until it says (until the deadline; its failure of the whole set-up is raised meanwhile), else
        None at once when it has not said yet."""
        name = kind_name(kind, owner)
        if wait:
            value = self.read(name, owner, f"how its set-up of {kind} links ended")
        else:
            value = self.peek(name, owner)
            if value is None:
                return None
        try:
            if value["made"] is True:
                return None
            origin = value["origin"]
            if not isinstance(origin, int):
                raise TypeError("origin")
            return GaveUp(owner, origin, str(value["error"]), str(value["device"]), str(value["message"]))
        except (TypeError, KeyError):
            raise HandshakeError(f"rank {self.rank}: record {name} in the rendezvous store (rank {owner}'s) does "
                                 f"not say how its set-up of {kind} links ended", why="store") from None

    # -- the group ----------------------------------------------------------------------------------------
    def join_group(self) -> GroupAuth:
        """The handshake key and id of this group. Rank 0 makes a fresh nonce and group id and publishes
        them (and keeps its own: it never reads them back); the key is derived from the secret when there is
        one, else it is the published nonce itself. Later records are bound to the group id."""
        if self.rank == 0:
            nonce, group_id = os.urandom(32), uuid.uuid4().hex
            self.publish(GROUP, {"nonce": nonce.hex(), "group": group_id}, scope="")
        else:
            shared = self.read(GROUP, 0, "the group's nonce")
            try:
                nonce, group_id = bytes.fromhex(shared["nonce"]), str(shared["group"])
            except (TypeError, KeyError, ValueError):
                raise HandshakeError(f"rank {self.rank}: record {GROUP} in the rendezvous store holds no nonce "
                                     f"and group id", why="store") from None
        self.scope = group_id
        return GroupAuth(hs.derive_key(self._secret, nonce, group_id) if self._secret else nonce, group_id)


_TAMPERED = ("someone who can write to the store (MASTER_ADDR:MASTER_PORT) but lacks THUNDERBOLT_SECRET "
             "rewrote it. Restart every rank, and firewall MASTER_PORT (README, Security)")
