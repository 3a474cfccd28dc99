"""A stranger in the middle, with THUNDERBOLT_SECRET set on every rank.

A process without the secret that can write to the rendezvous store rewrites rank 0's published endpoint
(`tb/ep/0`) before a late rank 1 reads it, accepts rank 1's streams and relays them to rank 0's real
endpoint. Every byte of the handshake is genuine, so a handshake that only proves the key passes through;
the relay then reads every tensor and may change any of them. The set-up must refuse it on every rank,
within the set-up timeout, naming the record: the record fails its MAC (the stranger lacks the secret),
and even a record that somehow passed would not help, as each end checks the addresses the other used.
"""
from __future__ import annotations

import json
import socket
import threading

import pytest
import torch

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import HandshakeError
from torch_thunderbolt.protocol import handshake as hs
from torch_thunderbolt.protocol.framing import FRAME_HEADER_SIZE
from torch_thunderbolt.rendezvous.tcp import connect_tcp
from torch_thunderbolt.testing.worlds import SetUpOnThreads, all_reduce_on_threads

pytestmark = pytest.mark.timeout(90)
SECRET = b"0123456789abcdef" * 4


class Relay:
    """Accepts connections on 127.0.0.1 and forwards each to `target`, both ways, byte for byte, except that
    with `flip` it flips one payload byte of the first frame rank 1 sends on its first stream."""

    def __init__(self, target: tuple[str, int], flip: bool) -> None:
        self.target, self.flip = target, flip
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.lst.settimeout(0.2)
        self.port = self.lst.getsockname()[1]
        self.accepted = 0
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.lst.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=10)
            self.socks += [client, server]
            # The first byte of the first frame's payload after the HELLO, on the first stream only.
            flip_at = hs.HELLO_SIZE + FRAME_HEADER_SIZE if self.flip and self.accepted == 0 else None
            self.accepted += 1
            for src, dst, at in ((client, server, flip_at), (server, client, None)):
                t = threading.Thread(target=self._pipe, args=(src, dst, at), daemon=True)
                t.start()
                self.threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket, flip_at: "int | None") -> None:
        seen = 0
        try:
            src.settimeout(None)
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data[flip_at - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.lst.close()
        for s in self.socks:
            s.close()
        for t in self.threads:
            t.join(5)


@pytest.fixture
def world():
    with SetUpOnThreads(2, connect_tcp) as w:
        yield w


def _value(raw: bytes):
    """What a record holds, as anyone reading the store sees it (as records.unchecked_value reads it; written
    out here so that the test also reads a record that is plain JSON, without a MAC)."""
    rec = json.loads(raw)
    return json.loads(rec["value"]) if "value" in rec else rec


def _endpoint(view) -> tuple[str, int]:
    view.wait(["tb/ep/0"])
    host, port = _value(view.get("tb/ep/0"))["endpoints"][0]
    return host, int(port)


def _rewrite_port(view, port: int, relay: int) -> None:
    """Rewrite rank 0's endpoint record as a stranger can: the same bytes with the relay's port."""
    raw = view.get("tb/ep/0")
    forged = raw.replace(f", {port}]".encode(), f", {relay}]".encode())
    assert forged != raw
    view.set("tb/ep/0", forged)


def _outcome(world: SetUpOnThreads) -> str:
    """How the set-up ended, for the assertion message: the failure this guards against is a silent wrong
    result, so the message says whether the sums came out right."""
    if world.errors:
        return repr(world.errors)
    got = all_reduce_on_threads(world.results, lambda r: torch.arange(64, dtype=torch.float32) * (r + 1))
    right = sum(torch.equal(x, torch.arange(64, dtype=torch.float32) * 3) for x in got.values())
    return f"the set-up passed through the relay; {right} of {len(got)} ranks got the right all_reduce"


@pytest.mark.parametrize("flip", [True, False], ids=["flips-a-byte", "forwards-only"])
def test_a_relay_behind_a_rewritten_endpoint_is_refused_on_every_rank_naming_the_record(world, flip) -> None:
    cfg = Config(streams=2, secret=SECRET, connect_timeout=30)
    world.start(0, cfg)
    host, port = _endpoint(world.view)
    relay = Relay((host, port), flip=flip)
    try:
        _rewrite_port(world.view, port, relay.port)
        world.start(1, cfg)  # late: it reads the rewritten record
        world.join()
        assert set(world.errors) == {0, 1}, _outcome(world)
        for r, exc in world.errors.items():
            assert isinstance(exc, HandshakeError), (r, repr(exc))
            text = str(exc)
            assert text.startswith(f"rank {r}: ") and "tb/ep/0" in text and "tampered" in text, text
            assert "same THUNDERBOLT_SECRET" not in text, text  # nobody had another secret
        assert "rank 1 gave up during set-up" in str(world.errors[0])
        assert relay.accepted == 0  # rank 1 never dialled the stranger
    finally:
        relay.close()


def test_a_relay_behind_a_record_that_passed_its_check_is_refused_by_the_addresses(world) -> None:
    """Defence in depth: even if a rewritten record were accepted (here the test signs it with the job's
    secret), a relay that forwards every byte unchanged is refused, since the addresses in the HELLO are
    not those of the connection rank 0 accepted; on both ranks, naming the record."""
    from torch_thunderbolt.rendezvous.records import Records

    cfg = Config(streams=2, secret=SECRET, connect_timeout=30)
    world.start(0, cfg)
    host, port = _endpoint(world.view)
    relay = Relay((host, port), flip=False)
    try:
        forger = Records(world.view, 0, SECRET, 0.0)
        forger.scope = _value(world.view.get("tb/group"))["group"]
        value = _value(world.view.get("tb/ep/0"))
        value["endpoints"] = [[host, relay.port]]
        world.view.set("tb/ep/0", forger.encode("tb/ep/0", value))
        world.start(1, cfg)
        world.join()
        assert set(world.errors) == {0, 1}, _outcome(world)
        assert relay.accepted >= 1  # this time rank 1 did dial the relay
        for r, exc in world.errors.items():
            assert isinstance(exc, HandshakeError) and exc.why == "relay", (r, repr(exc))
            text = str(exc)
            assert "relay" in text and "tampered" in text and "tb/ep/" in text, text
        assert f"127.0.0.1:{relay.port}" in str(world.errors[0])  # what rank 1 dialled, as rank 0 saw it
    finally:
        relay.close()


def test_without_a_relay_the_records_and_addresses_check_out(world) -> None:
    """The same two ranks with nobody in the middle, two streams each: connected, exact results."""
    cfg = Config(streams=2, secret=SECRET, connect_timeout=30)
    world.start(0, cfg)
    world.start(1, cfg)
    world.join()
    assert not world.errors, world.errors
    got = all_reduce_on_threads(world.results, lambda r: torch.arange(64, dtype=torch.float32) * (r + 1))
    assert all(torch.equal(got[r], torch.arange(64, dtype=torch.float32) * 3) for r in (0, 1))
    assert json.loads(world.view.get("tb/ep/0"))["mac"]  # the record is signed


@pytest.mark.parametrize("listen_all", [False, True], ids=["chosen-addresses", "listen-all"])
def test_two_cables_and_listen_all_pass_the_address_check(world, monkeypatch, listen_all) -> None:
    """Each rank on two addresses (127.0.0.1 and 127.0.0.2 stand for two cables, each its own network), a
    stream over each, so the link fails over between them; with THUNDERBOLT_LISTEN_ALL the listener is
    0.0.0.0 and the accepted socket's own address is what the client must have dialled."""
    from torch_thunderbolt.rendezvous import tcp as bootstrap

    monkeypatch.setattr(bootstrap, "choose_addresses", lambda ifnames, host: ["127.0.0.1", "127.0.0.2"])
    monkeypatch.setattr(bootstrap, "network_of", lambda a: f"{a}/32")
    cfg = Config(streams=2, secret=SECRET, listen_all=listen_all, connect_timeout=30)
    world.start(0, cfg)
    world.start(1, cfg)
    world.join()
    assert not world.errors, world.errors
    link = world.results[1].link_kind("tcp").links[0]
    assert sorted(c.local for c in link.streams) == (["127.0.0.1", "127.0.0.1"] if listen_all
                                                     else ["127.0.0.1", "127.0.0.2"])
    assert link.failover is not listen_all  # one published endpoint with LISTEN_ALL: one address pair
    got = all_reduce_on_threads(world.results, lambda r: torch.arange(64, dtype=torch.float32) * (r + 1))
    assert all(torch.equal(got[r], torch.arange(64, dtype=torch.float32) * 3) for r in (0, 1))
