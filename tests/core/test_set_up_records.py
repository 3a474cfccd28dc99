"""Every record the set-up reads from the (unauthenticated) rendezvous store is checked with the job's key,
and a rank that gives up tells the others why.

With THUNDERBOLT_SECRET a record someone rewrote fails on every rank with a HandshakeError naming it; a rank
with another secret is named as one that failed its handshake, with the hint about the secret, which a
stranger's garbage does not earn. The Records unit tests pin what a MAC covers.
"""
from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError, HandshakeError, PeerLostError, RdmaError
from torch_thunderbolt.protocol import handshake as hs
from torch_thunderbolt.rendezvous import agree
from torch_thunderbolt.rendezvous.group import connect
from torch_thunderbolt.rendezvous.hosts import recv_exact
from torch_thunderbolt.rendezvous.records import GaveUp, Records, unchecked_value
from torch_thunderbolt.testing.worlds import SetUpOnThreads

pytestmark = pytest.mark.timeout(90)
SECRET = b"0123456789abcdef" * 4
OTHER = b"fedcba9876543210" * 4
HINT = "same THUNDERBOLT_SECRET"


class World(SetUpOnThreads):
    """Ranks as threads calling rendezvous.group.connect (what the backend calls) over one TCPStore; rank
    `rank` may read the store through a stranger's rewriting of record `rewrite`."""

    def start(self, rank: int, cfg: Config, rewrite: str = "") -> None:
        super().start(rank, cfg, (lambda store: Rewriting(store, rewrite)) if rewrite else None)


class Rewriting:
    """A rank's view of the store in which a stranger has rewritten record `name` (its value changed, its
    MAC kept) by the time this rank reads it."""

    def __init__(self, store, name: str) -> None:
        self.store, self.name = store, name

    def set(self, key, value):
        return self.store.set(key, value)

    def check(self, keys):
        return self.store.check(keys)

    def get(self, key):
        raw = self.store.get(key)
        if key != self.name:
            return raw
        rec = json.loads(raw)
        value = json.loads(rec["value"])
        value = {**value, "stranger": 1} if isinstance(value, dict) else [value, "stranger"]
        return json.dumps({**rec, "value": json.dumps(value)}).encode()


@pytest.fixture
def make_world():
    with contextlib.ExitStack() as made:
        yield lambda n: made.enter_context(World(n, connect, close_result=lambda c: c.transport.close()))


# (record, THUNDERBOLT_TRANSPORT): every record a rank reads from another during set-up but the last.
RECORDS = [("tb/group", "tcp"), ("tb/ep/0", "tcp"), ("tb/rank/0", "auto"), ("tbshm/token/0", "shm"),
           ("tbshm/0", "shm")]


@pytest.mark.parametrize("record, transport", RECORDS)
def test_a_rewritten_record_fails_the_set_up_on_every_rank_naming_it(make_world, record, transport) -> None:
    world = make_world(2)
    cfg = Config(streams=2, secret=SECRET, transport=transport, connect_timeout=30)
    world.start(0, cfg)
    world.start(1, cfg, rewrite=record)
    world.join()
    assert set(world.errors) == {0, 1}, world.errors
    for r, exc in world.errors.items():
        assert isinstance(exc, HandshakeError), (r, repr(exc))
        text = str(exc)
        assert text.startswith(f"rank {r}: ") and record in text and "tampered" in text, text
        assert HINT not in text, text
    assert "rank 1 gave up during set-up" in str(world.errors[0])


def test_a_rewritten_last_record_fails_the_rank_that_reads_it(make_world) -> None:
    """The ready record is the last one of the shared-memory set-up: rank 0 may have read rank 1's and
    finished before rank 1 reads rank 0's, so only rank 1 is sure to fail at set-up (rank 0's first
    operation then finds rank 1 gone)."""
    world = make_world(2)
    cfg = Config(secret=SECRET, transport="shm", connect_timeout=30)
    world.start(0, cfg)
    world.start(1, cfg, rewrite="tbshm/ready/0")
    world.join()
    exc = world.errors[1]
    assert isinstance(exc, HandshakeError) and "tbshm/ready/0" in str(exc) and "tampered" in str(exc), repr(exc)


def test_three_ranks_one_with_another_secret_is_named_as_failing_its_handshake(make_world) -> None:
    """Rank 2 has another THUNDERBOLT_SECRET: it finds rank 0's group record signed with another key and
    gives up; ranks 0 and 1 say that rank 2 failed its handshake (not that it died), with the hint."""
    world = make_world(3)
    for r in range(3):
        world.start(r, Config(streams=1, secret=OTHER if r == 2 else SECRET, transport="tcp", connect_timeout=30))
    world.join()
    assert set(world.errors) == {0, 1, 2}, world.errors
    assert "rank 0's record tb/group is signed with another key" in str(world.errors[2])
    for r in (0, 1):
        exc = world.errors[r]
        assert isinstance(exc, HandshakeError), (r, repr(exc))
        assert f"rank {r}: rank 2 failed its handshake" in str(exc) and HINT in str(exc), str(exc)
        assert "died" not in str(exc)


def _stranger_hello(view, key: bytes | None) -> None:
    """Connect to rank 0 as a stranger: random bytes (`key` None), or a well-formed HELLO as rank 1 (the
    group id read from the store) with a MAC made with `key`, which is not the job's."""
    view.wait(["tb/ep/0", "tb/group"])
    host, port = unchecked_value(view.get("tb/ep/0"))["endpoints"][0]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        challenge = recv_exact(s, hs.CHALLENGE_SIZE)
        if key is None:
            s.sendall(bytes(range(256))[: hs.HELLO_SIZE])
        else:
            group = unchecked_value(view.get("tb/group"))["group"]
            client = hs.ClientHandshake(key, 1, 0, 0, group, dialled=s.getpeername(), local=s.getsockname())
            s.sendall(client.receive_challenge(challenge))
        s.recv(hs.REPLY_SIZE)


@pytest.mark.parametrize("hello", ["garbage", "wrong-key"])
def test_the_secret_hint_only_for_a_hello_that_failed_its_mac(make_world, hello) -> None:
    """Rank 1 never comes; a stranger connects to rank 0 meanwhile. Garbage is refused and mentioned, but
    is no reason to suspect the secret; a HELLO as rank 1 whose MAC fails is: rank 1 failed its handshake."""
    world = make_world(2)
    cfg = Config(streams=1, secret=SECRET, transport="tcp", connect_timeout=4)
    world.start(0, cfg)
    # Rank 1 gets as far as publishing its settings and who it is (which every rank does first), no further.
    from torch_thunderbolt.rendezvous.hosts import host_identity

    rank_1 = Records(world.view, 1, SECRET, time.monotonic() + 10)
    rank_1.join_group()
    rank_1.publish(agree.SETTINGS.format(rank=1), agree.my_settings(cfg))
    rank_1.publish("tb/rank/1", {"host": host_identity(), "offers": {"shm": None, "tcp": None}})
    _stranger_hello(world.view, None if hello == "garbage" else b"x" * 32)
    world.join()
    exc = world.errors[0]
    text = str(exc)
    assert "timed out waiting for ranks [1]" in text and "refused" in text, text
    if hello == "garbage":
        assert isinstance(exc, PeerLostError) and HINT not in text, text
    else:
        assert isinstance(exc, HandshakeError) and "rank 1 failed its handshake" in text and HINT in text, text


# -- Records without a network ------------------------------------------------------------------------


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def _pair(secret_a: bytes = SECRET, secret_b: bytes = SECRET) -> tuple[Records, Records, DictStore]:
    store = DictStore()
    a, b = Records(store, 0, secret_a, time.monotonic() + 5), Records(store, 1, secret_b, time.monotonic() + 5)
    return a, b, store


def test_a_signed_record_reads_back_and_binds_its_name_group_and_value() -> None:
    a, b, store = _pair()
    assert a.join_group().key == b.join_group().key
    a.publish("tb/ep/0", {"endpoints": [["10.0.0.1", 5]]})
    assert b.read("tb/ep/0", 0) == {"endpoints": [["10.0.0.1", 5]]}
    store.data["tb/ep/1"] = store.data["tb/ep/0"]  # the same record under another rank's name
    with pytest.raises(HandshakeError, match="tampered.*tb/ep/1") as info:
        b.read("tb/ep/1", 1)
    assert info.value.why == "store"
    other = Records(store, 1, SECRET, time.monotonic() + 5)
    other.scope = "another group"  # a record of another group (or job) with the same secret: a replay
    with pytest.raises(HandshakeError, match="tampered"):
        other.read("tb/ep/0", 0)


def test_records_from_another_secret_or_none_are_named_as_such() -> None:
    a, b, store = _pair(SECRET, OTHER)
    a.publish("tb/x", 1)
    with pytest.raises(HandshakeError, match="another key") as info:
        b.read("tb/x", 0)
    assert info.value.why == "mac" and HINT in str(info.value)
    plain = Records(store, 2, b"", time.monotonic() + 5)
    with pytest.raises(ConfigError, match="rank 0 has THUNDERBOLT_SECRET set but this rank has none"):
        plain.read("tb/x", 0)
    plain.publish("tb/y", 2)
    with pytest.raises(ConfigError, match="rank 2 published record tb/y without a MAC"):
        a.read("tb/y", 2)


def test_a_missing_mac_from_a_rank_whose_records_were_signed_is_tampering() -> None:
    a, b, store = _pair()
    a.publish("tb/one", 1)
    assert b.read("tb/one", 0) == 1
    Records(store, 0, b"", 0.0).publish("tb/two", 2)  # a stranger, who cannot sign
    with pytest.raises(HandshakeError, match="tampered.*carries no MAC"):
        b.read("tb/two", 0)


def test_a_failure_is_announced_once_and_raised_by_whoever_waits_for_that_rank() -> None:
    a, b, store = _pair()
    a.announce(ConfigError("rank 0: THUNDERBOLT_SHM_SLOT differs"))
    a.announce(ValueError("a later, secondary error"))
    with pytest.raises(ConfigError, match="rank 1: rank 0 gave up during set-up: ConfigError: rank 0: THUNDER"):
        b.read("tb/never", 0)
    with pytest.raises(PeerLostError, match="timed out waiting for rank 2"):
        Records(store, 1, SECRET, time.monotonic() + 0.05).read("tb/never", 2)


def test_giving_up_one_kind_is_raised_by_whoever_waits_in_that_kind_only() -> None:
    """A rank that gives up RDMA alone (its device failed) ends every wait for it in the RDMA set-up, as the
    error it was and naming where it failed, while the group's other records are read as usual; how each
    rank's set-up of the kind ended is read back, signed and bound to the group like every record."""
    a, b, store = _pair()
    a.join_group(), b.join_group()
    b.made("rdma")
    assert a.outcome("rdma", 1) is None and a.outcome("rdma", 0, wait=False) is None  # made; not said yet
    learned = RdmaError("rank 0: rank 3 gave up setting up rdma links: ...", device="rdma_en5", rank=3)
    a.give_up("rdma", learned)
    a.give_up("rdma", RdmaError("a later, secondary error"))
    assert a.gave_up("rdma") and not a.gave_up("shm") and not b.gave_up("rdma")
    assert b.outcome("rdma", 0) == GaveUp(0, 3, "RdmaError", "rdma_en5", str(learned))
    assert b.failure(0) is None  # not a failure of the group's set-up
    with pytest.raises(RdmaError, match="rank 1: rank 0 gave up setting up rdma links: rank 0: rank 3") as info:
        b.read("tbrdma/qp/0", 0, "its queue pairs", kind="rdma")
    assert info.value.device == "rdma_en5" and info.value.rank == 3
    with pytest.raises(PeerLostError, match="timed out waiting for rank 0"):
        Records(store, 1, SECRET, time.monotonic() + 0.05).read("tb/ep/0", 0)  # another kind's wait goes on
    store.data["tb/kind/rdma/1"] = store.data["tb/kind/rdma/0"]  # rank 0's giving up, replayed as rank 1's
    with pytest.raises(HandshakeError, match="tampered.*tb/kind/rdma/1"):
        a.outcome("rdma", 1)
    assert isinstance(a.failure(1, "rdma"), HandshakeError)
    a.publish("tb/kind/rdma/0", {"made": False})
    with pytest.raises(HandshakeError, match="does not say how its set-up of rdma links ended"):
        b.outcome("rdma", 0)


@pytest.mark.parametrize("raw", [b"garbage", b"[1, 2]", b'"text"', b'{"value": 5}', b'{"value": "{not json"}',
                                 b"\xff\xfe"])
@pytest.mark.parametrize("secret", [SECRET, b""])
def test_a_record_that_is_not_one_is_a_handshake_error_naming_it(raw: bytes, secret: bytes) -> None:
    store = DictStore()
    store.data["tb/ep/0"] = raw
    with pytest.raises(HandshakeError, match="record tb/ep/0 .* is not a set-up record") as info:
        Records(store, 1, secret, time.monotonic() + 5).read("tb/ep/0", 0)
    assert info.value.why == "store"
