"""THUNDERBOLT_INTEGRITY=mac: a keyed BLAKE2b MAC on every TCP frame.

Sans-IO first (a frame changed anywhere, replayed, reordered, dropped or injected fails), then two sealed
transports with a frame-aware stranger on the wire between them (the group fails on both ranks with an
IntegrityError, never a wrong result), then the set-up: sealed links only when asked for, only with a
secret, and only when every rank asks for it.
"""
from __future__ import annotations

import datetime
import gc
import inspect
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError, IntegrityError, ProtocolError
from torch_thunderbolt.protocol import control
from torch_thunderbolt.protocol.framing import FRAME_HEADER_SIZE, AbortInfo, Kind, Space, _parse, encode_frame_header
from torch_thunderbolt.protocol.integrity import (SEALED_HEADER_SIZE, TAG_SIZE, Opener, SealedFrameDecoder, Sealer,
                                                  stream_keys)
from torch_thunderbolt.rendezvous.group import connect
from torch_thunderbolt.transport.tcp import SealedTcpLink, TcpLink, tcp_transport
from torch_thunderbolt.algorithms.collectives import Communicator
from torch_thunderbolt.testing.worlds import on_threads

pytestmark = pytest.mark.timeout(60)
SECRET = b"0123456789abcdef" * 4
KEY = b"k" * 32


def _frames(payloads: list[bytes], key: bytes = KEY) -> list[bytes]:
    sealer = Sealer(key)
    out = []
    for i, p in enumerate(payloads):
        hdr = encode_frame_header(Kind.DATA, Space.COLL, 7, 1, i, 0, len(p), len(p))
        out.append(sealer.seal(hdr, p) + p)
    return out


def _read_all(wire: bytes, key: bytes = KEY) -> list[bytes]:
    dec = SealedFrameDecoder(Opener(key, "rank 0: a frame from rank 1"), 1 << 20)
    dec.feed(wire)
    got = []
    while (f := dec.next_frame()) is not None:
        payload = dec.take_buffered(f.length)
        if len(payload) < f.length:
            raise AssertionError("short")
        if f.length:
            dec.opener.check(payload)
        got.append(payload)
    return got


def test_sealed_frames_read_back() -> None:
    payloads = [b"", b"x", os.urandom(1000)]
    assert _read_all(b"".join(_frames(payloads))) == payloads
    assert len(_frames([b""])[0]) == SEALED_HEADER_SIZE == FRAME_HEADER_SIZE + 2 * TAG_SIZE


@pytest.mark.parametrize("what", ["change", "drop", "replay", "reorder", "other-key", "plain"])
def test_a_stream_whose_frames_were_meddled_with_fails(what: str) -> None:
    frames = _frames([b"a" * 10, b"b" * 20, b"c" * 30])
    if what == "drop":
        frames.pop(1)
    elif what == "replay":
        frames.insert(1, frames[0])
    elif what == "reorder":
        frames[0], frames[1] = frames[1], frames[0]
    elif what == "other-key":
        frames[1] = _frames([b"a" * 10, b"b" * 20], key=b"o" * 32)[1]
    elif what == "plain":
        frames[1] = encode_frame_header(Kind.DATA, Space.COLL, 7, 1, 1, 0, 20, 20) + b"b" * 20 + bytes(32)
    else:
        frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 1])
    with pytest.raises(IntegrityError, match="rank 0: a frame from rank 1: .*failed its MAC"):
        _read_all(b"".join(frames))


@given(st.integers(0, 3 * SEALED_HEADER_SIZE + 59), st.integers(1, 255))
@settings(max_examples=300, deadline=None)
def test_any_changed_byte_fails(position: int, mask: int) -> None:
    wire = bytearray(b"".join(_frames([b"a" * 10, b"b" * 20, b"c" * 29])))
    wire[position % len(wire)] ^= mask
    with pytest.raises(IntegrityError):
        _read_all(bytes(wire))


@given(st.binary(max_size=400))
@settings(max_examples=300, deadline=None)
def test_fuzz_only_protocol_errors_escape(data: bytes) -> None:
    try:
        _read_all(data)
    except (ProtocolError, AssertionError):
        pass


def test_an_unwritten_frame_gives_its_number_back() -> None:
    sealer = Sealer(KEY)
    hdr = encode_frame_header(Kind.DATA, Space.COLL, 7, 1, 0, 0, 1, 1)
    passed_over = sealer.seal(hdr, b"x")
    assert sealer.unseal(passed_over) == hdr and sealer.seq == 0
    assert _read_all(sealer.seal(hdr, b"y") + b"y") == [b"y"]


def test_stream_keys_differ_per_direction_and_connection() -> None:
    send, recv = stream_keys(KEY, 0, 1)
    assert stream_keys(KEY, 1, 0) == (recv, send) and send != recv
    assert stream_keys(b"j" * 32, 0, 1)[0] not in (send, recv)


def test_the_small_message_path_has_no_integrity_work_when_the_mode_is_off() -> None:
    """The latency-critical path of plain links must not pay for this mode: the sealed link overrides it,
    so the plain one never looks at a sealer (the checks live only where a frame is queued or completed)."""
    for fn in (TcpLink.send, TcpLink.take, TcpLink._write_whole, TcpLink._give_back):
        src = inspect.getsource(fn)
        assert "seal" not in src and "opener" not in src, fn
    for name in ("take", "_write_whole"):
        assert getattr(SealedTcpLink, name) is not getattr(TcpLink, name)


# -- two sealed transports with a stranger on the wire between them -----------------------------------


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lst:
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
    return a, b


class Meddler:
    """Forwards one stream both ways; in the direction rank 1 -> rank 0 it cuts the bytes into sealed frames
    and does `what` to frame number `at` (counting from 0)."""

    def __init__(self, to_rank0: socket.socket, to_rank1: socket.socket, what: str, at: int) -> None:
        self.what, self.at = what, at
        self.done = False
        self.socks = (to_rank0, to_rank1)
        self.threads = [threading.Thread(target=self._frames, args=(to_rank1, to_rank0), daemon=True),
                        threading.Thread(target=self._bytes, args=(to_rank0, to_rank1), daemon=True)]
        for t in self.threads:
            t.start()

    def _bytes(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        buf, n, held = b"", 0, None
        try:
            while data := src.recv(1 << 16):
                buf += data
                while len(buf) >= SEALED_HEADER_SIZE:
                    size = SEALED_HEADER_SIZE + _parse(buf[:FRAME_HEADER_SIZE], 1 << 40).length
                    if len(buf) < size:
                        break
                    frame, buf = buf[:size], buf[size:]
                    out = [frame]
                    if n == self.at:
                        self.done = True
                        if self.what == "flip-payload":
                            out = [frame[:-1] + bytes([frame[-1] ^ 0x80])]
                        elif self.what == "flip-header":
                            out = [frame[:20] + bytes([frame[20] ^ 1]) + frame[21:]]  # the tag field
                        elif self.what == "drop":
                            out = []
                        elif self.what == "replay":
                            out = [frame, frame]
                        elif self.what == "reorder":
                            held, out = frame, []
                    elif held is not None:
                        out, held = [frame, held], None
                    n += 1
                    for f in out:
                        dst.sendall(f)
        except (OSError, ProtocolError):
            pass

    def close(self) -> None:
        for s in self.socks:
            s.close()
        for t in self.threads:
            t.join(5)


def _sealed_pair(what: str | None = None, at: int = 0, streams: int = 1, stripe: int = 256 << 10):
    """Rank 0 and rank 1 as sealed transports in this process; a Meddler on stream 0 if `what`."""
    sessions = [os.urandom(32) for _ in range(streams)]
    socks0, socks1, meddlers = [], [], []
    for i in range(streams):
        a0, b0 = _socket_pair()
        if what is not None and i == 0:
            a1, b1 = _socket_pair()
            meddlers.append(Meddler(b0, a1, what, at))  # rank 0 <-> a0 ... b0 <meddler> a1 ... b1 <-> rank 1
            socks0.append(a0)
            socks1.append(b1)
        else:
            socks0.append(a0)
            socks1.append(b0)
    t0 = tcp_transport(0, 2, {1: socks0}, stripe_bytes=stripe,
                       seal=(0, {1: [stream_keys(s, 0, 1) for s in sessions]}))
    t1 = tcp_transport(1, 2, {0: socks1}, stripe_bytes=stripe,
                       seal=(1, {0: [stream_keys(s, 1, 0) for s in sessions]}))
    return t0, t1, meddlers


def _send_messages(t0, t1, sizes: list[int]) -> tuple[dict, list]:
    """Rank 1 sends a message of each size to rank 0, then waits for an answer that never comes (so it sees
    what rank 0 tells it); rank 0 receives them. Returns each rank's error and rank 0's buffers."""
    errors: dict = {}
    bufs = [bytearray(n) for n in sizes]

    def rank0() -> None:
        reqs = [t0.irecv(1, (Space.COLL, i + 1, 1), memoryview(b)) for i, b in enumerate(bufs)]
        try:
            t0.wait(reqs, deadline=time.monotonic() + 20)
        except BaseException as exc:  # noqa: BLE001
            errors[0] = exc
        else:
            t0.close()  # all arrived: leave, so rank 1's unanswered receive ends now, not at its deadline

    def rank1() -> None:
        msgs = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
        reqs = [t1.isend(0, (Space.COLL, i + 1, 1), memoryview(m)) for i, m in enumerate(msgs)]
        reqs.append(t1.irecv(0, (Space.COLL, 99, 0), memoryview(bytearray(8))))
        try:
            t1.wait(reqs, deadline=time.monotonic() + 20)
        except BaseException as exc:  # noqa: BLE001
            errors[1] = exc

    threads = [threading.Thread(target=f) for f in (rank0, rank1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return errors, bufs


@pytest.mark.parametrize("what", ["flip-payload", "flip-header", "drop", "replay", "reorder"])
@pytest.mark.parametrize("at", [0, 2])
def test_a_stranger_on_the_wire_fails_the_group_on_both_ranks(what: str, at: int) -> None:
    t0, t1, meddlers = _sealed_pair(what, at)
    try:
        errors, _ = _send_messages(t0, t1, [100, 5000, 64, 70_000, 8])
        assert meddlers[0].done
        assert isinstance(errors.get(0), IntegrityError), errors
        assert "rank 0: a frame from rank 1 on stream 0" in str(errors[0]) and "failed its MAC" in str(errors[0])
        assert isinstance(errors.get(1), IntegrityError), errors  # told by rank 0's ABORT, itself sealed
        assert "rank 1: rank 0 aborted the group" in str(errors[1])
    finally:
        t0.close()
        t1.close()
        for m in meddlers:
            m.close()


def test_an_unsealed_control_message_is_refused_on_a_sealed_link() -> None:
    """Control frames are sealed like data: an ABORT written without its MAC (a stranger, or a peer without
    the key) is an IntegrityError, never a reason the group believes."""
    t0, t1, _ = _sealed_pair()
    try:
        forged = control.framed(control.Abort(AbortInfo("MismatchError", "believe me", 1)))
        t1.link_kind("tcp").stream(0, 0).sock.sendall(forged)
        req = t0.irecv(1, (Space.COLL, 1, 0), memoryview(bytearray(8)))
        with pytest.raises(IntegrityError):
            t0.wait([req], deadline=time.monotonic() + 10)
    finally:
        t0.close()
        t1.close()


def test_sealed_transports_move_messages_of_every_size_exactly() -> None:
    t0, t1, _ = _sealed_pair(streams=2, stripe=64 << 10)
    try:
        sizes = [0, 1, 4096, 65536, 1 << 20, (3 << 20) + 7]
        errors, bufs = _send_messages(t0, t1, sizes)
        assert set(errors) == {1}  # only rank 1's unanswered receive, cut short by rank 0 leaving
    finally:
        t0.close()
        t1.close()
    assert all(bytes(b) == bytes([i + 1]) * n for i, (b, n) in enumerate(zip(bufs, sizes)))


# -- through the set-up ---------------------------------------------------------------------------------


def test_integrity_needs_a_secret_and_one_of_two_values() -> None:
    with pytest.raises(ConfigError, match="THUNDERBOLT_INTEGRITY=mac needs THUNDERBOLT_SECRET"):
        Config.from_env({"THUNDERBOLT_INTEGRITY": "mac"})
    with pytest.raises(ConfigError, match="THUNDERBOLT_INTEGRITY: expected one of none, mac"):
        Config.from_env({"THUNDERBOLT_INTEGRITY": "sha"})
    cfg = Config.from_env({"THUNDERBOLT_INTEGRITY": "MAC", "THUNDERBOLT_SECRET": SECRET.decode()})
    assert cfg.integrity == "mac" and Config.from_env({}).integrity == "none"


def _connect_two(cfgs: list[Config]) -> tuple[dict, dict]:
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    out: dict = {}
    errors: dict = {}

    def run(r: int) -> None:
        try:
            st = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=30))
            out[r] = connect(dist.PrefixStore("job/", st), r, 2, cfgs[r], 30).transport
        except BaseException as exc:  # noqa: BLE001
            errors[r] = exc
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    del server
    gc.collect()
    return out, errors


def test_the_set_up_seals_every_stream_and_results_stay_exact() -> None:
    cfg = Config(streams=2, secret=SECRET, integrity="mac", transport="tcp")
    transports, errors = _connect_two([cfg, cfg])
    try:
        assert not errors, errors
        for r, t in transports.items():
            link = t.link_kind("tcp").links[1 - r]
            assert isinstance(link, SealedTcpLink) and all(c.sealer is not None for c in link.streams)
        def body(r: int) -> list[torch.Tensor]:
            comm = Communicator(transports[r], Config(), timeout=20)
            out = []
            for n in (16, 70_000, 1 << 20):  # one-shot, ring, striped over both streams
                x = torch.arange(n, dtype=torch.float32) * (r + 1)
                comm.all_reduce(x)
                out.append(x)
            return out
        run = on_threads(2, body, 40)
        assert not run.errors and not run.hung, run.errors
        for got in run.results:
            assert all(torch.equal(x, torch.arange(len(x), dtype=torch.float32) * 3) for x in got)
    finally:
        for t in transports.values():
            t.close()


def test_ranks_that_disagree_on_integrity_fail_naming_the_variable() -> None:
    cfgs = [Config(secret=SECRET, integrity="mac", transport="tcp"), Config(secret=SECRET, transport="tcp")]
    transports, errors = _connect_two(cfgs)
    for t in transports.values():
        t.close()
    assert set(errors) == {0, 1}, errors
    for r, exc in errors.items():
        assert isinstance(exc, ConfigError) and "THUNDERBOLT_INTEGRITY differs" in str(exc), (r, repr(exc))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "hybrid"])
def test_through_torch_with_integrity_on(transport: str, tmp_path) -> None:
    """init_process_group with THUNDERBOLT_INTEGRITY=mac: exact results; the hybrid (2 pretend hosts x 2
    ranks) seals its TCP links and keeps shared memory within each host."""
    from torch_thunderbolt.testing.ranks import run_ranks

    from .programs import secret_warning

    env = {"THUNDERBOLT_SECRET": SECRET.decode(), "THUNDERBOLT_INTEGRITY": "mac"}
    env.update({"THUNDERBOLT_TRANSPORT": "tcp"} if transport == "tcp" else {"TEST_FAKE_HOSTS": "1"})
    for res in run_ranks(secret_warning, 2 if transport == "tcp" else 4, tmp_path, timeout=90, env=env):
        assert res.json() == {"ok": True}, res.stderr[-3000:]
