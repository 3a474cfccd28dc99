"""Two processes, one end of a UC connection each, over the fake fabric the test made: rank r uses
rdma_fake<r> (unless TEST_DEVICE names one), found through THUNDERBOLT_VERBS as any job would. They meet
through files in the run's directory (no torch, no store: only the binding and the fabric are tested)."""
from __future__ import annotations

import json
import os
import select
import time
import zlib
from typing import Any

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import RdmaError
from torch_thunderbolt.testing.program import Exit, main, rank, result, workdir
from torch_thunderbolt.transport import verbs as v
from torch_thunderbolt.transport.providers import verbs_from_config
from torch_thunderbolt.testing.fake_verbs import Fabric

from ..fabric_ends import End, make_end

TIMEOUT = 30.0
# The first meeting also waits for the other process to start: importing torch alone takes 4 s on this idle
# machine and several times that on a loaded one, so 30 s counted from the first process's arrival is not
# enough there. (The tests' own timeouts, 120-150 s, still bound it.)
START_TIMEOUT = 100.0


def _publish(name: str, obj: Any = None) -> None:
    tmp = workdir() / f".{name}.{rank()}.tmp"
    tmp.write_text(json.dumps(obj))
    tmp.rename(workdir() / f"{name}.{rank()}")


def _await(name: str, who: int, timeout: float = TIMEOUT) -> Any:
    path = workdir() / f"{name}.{who}"
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank()}: rank {who} never published {name}")
        time.sleep(0.005)
    return json.loads(path.read_text())


def _barrier(name: str) -> None:
    _publish(name)
    _await(name, 1 - rank())


def _end(channel: bool = False) -> End:
    cfg = Config.from_env()
    assert cfg.verbs == "fake"
    device = os.environ.get("TEST_DEVICE") or f"rdma_fake{rank()}"
    end = make_end(cfg.verbs, cfg.verbs_fabric, device, channel=channel, max_wr=32, sge=2)
    _publish("info", end.info)
    end.connect(_await("info", 1 - rank(), START_TIMEOUT))
    return end


ECHO = 512 << 10  # echoes land in the second half of the 1 MiB buffer
SIZES = [1, 64, 4096, 5000, 8192, 130000, 260000, 524288]  # each covers 2^k frames


def _slot(size: int) -> int:
    """The receive that covers as many 4 KiB frames as a send of `size` bytes: 4 KiB x 2^k."""
    slot = 4096
    while slot < size:
        slot *= 2
    return slot


def pingpong() -> None:
    """Rank 0 sends messages of every size (rank 1 sleeps on its completion channel between them),
    rank 1 echoes each back; both check every byte."""
    me = rank()
    end = _end(channel=(me == 1))
    rounds = 3
    offset = 0
    if me == 1:
        for i in range(len(SIZES) * rounds):  # receives posted after RTS, before the peer may send
            end.recv(i, 0, _slot(SIZES[i % len(SIZES)]))
    _barrier("posted")
    sums, woke = [], 0
    for i in range(len(SIZES) * rounds):
        size = SIZES[i % len(SIZES)]
        if me == 0:
            payload = bytes((i * 7 + j) % 251 for j in range(min(size, 4096))) * (size // 4096 + 1)
            end.buffer[offset:offset + size] = payload[:size]
            end.recv(1000 + i, ECHO, _slot(size))
            end.send(i, offset, size)
            got = end.wait(2, TIMEOUT)
            ids = sorted(c[0] for c in got)
            assert ids == [i, 1000 + i] and all(c[1] == v.IBV_WC_SUCCESS for c in got), got
            assert end.buffer[ECHO:ECHO + size] == end.buffer[offset:offset + size], f"echo of {size}"
            sums.append(zlib.crc32(end.buffer[ECHO:ECHO + size]))
        else:
            assert end.channel is not None
            end.cq.req_notify()
            got = end.cq.completions()
            if not got:
                ready, _, _ = select.select([end.channel.fd], [], [], TIMEOUT)
                assert ready, "no completion event"
                end.channel.get_event()
                end.cq.ack(1)
                woke += 1
                got = end.wait(1, TIMEOUT)
            [(wr_id, status, _, byte_len, _)] = got
            assert (wr_id, status, byte_len) == (i, v.IBV_WC_SUCCESS, size), got
            sums.append(zlib.crc32(end.buffer[:size]))
            end.send(5000 + i, 0, size)
            assert [c[:2] for c in end.wait(1, TIMEOUT)] == [(5000 + i, v.IBV_WC_SUCCESS)]
    result({"sums": sums, "woke": woke, "failures": end.verbs.provider.failures})
    _barrier("done")
    end.close()


def faults() -> None:
    """Faults one process sets, seen by the other: lost frames, a stalled peer, a port down, a device that
    disappears; then a wedged port on re-connect."""
    me, peer = rank(), 1 - rank()
    cfg = Config.from_env()
    fabric = Fabric(cfg.verbs_fabric)
    end = _end()
    out: dict[str, Any] = {}
    mine, theirs = f"rdma_fake{me}", f"rdma_fake{peer}"

    # lost frames: rank 0's device drops its next message
    if me == 1:
        end.recv(1, 0, 4096)  # one receive: the lost message takes none, the next one lands here
    _barrier("drop")
    if me == 0:
        fabric.set_fault(mine, "drop_next", 1)
        for i, byte in ((10, 0xA), (11, 0xB)):
            end.buffer[0] = byte
            end.send(i, 0, 1)
            assert [c[:2] for c in end.wait(1, TIMEOUT)] == [(i, v.IBV_WC_SUCCESS)]
        out["dropped"] = fabric.dropped(mine)
    else:
        got = end.wait(1, TIMEOUT) + end.wait(1, 0.3)
        out["drop"] = [[c[0], c[3], end.buffer[0]] for c in got]

    # a stalled peer: rank 0 stalls rank 1's device; rank 1 releases it later, rank 0's send goes then
    if me == 1:
        end.recv(3, 0, 4096)
    _barrier("stall")
    if me == 0:
        fabric.set_fault(theirs, "stall", 1)
        end.send(20, 0, 8)
        out["held"] = end.wait(1, 0.3) == []
        _publish("stalled")
        out["after_release"] = [c[:2] for c in end.wait(1, TIMEOUT)]
    else:
        _await("stalled", 0)
        out["nothing_while_stalled"] = end.wait(1, 0.3) == []
        fabric.set_fault(mine, "stall", 0)
        out["after_release"] = [c[:2] for c in end.wait(1, TIMEOUT)]

    # the port of rank 1 goes down: rank 1 sees DOWN, rank 0's message is lost
    _barrier("port")
    if me == 1:
        end.recv(4, 0, 4096)
        fabric.set_fault(mine, "port_up", 0)
        out["port"] = end.device.query_port().state_name
    _barrier("port_down")
    if me == 0:
        end.send(30, 0, 8)
        out["sent_down"] = [c[:2] for c in end.wait(1, TIMEOUT)]
    else:
        out["nothing_while_down"] = end.wait(1, 0.3) == []
        fabric.set_fault(mine, "port_up", 1)

    # rank 0 makes rank 1's device disappear
    _barrier("gone")
    if me == 0:
        fabric.set_fault(theirs, "present", 0)
    _barrier("gone_set")
    if me == 1:
        try:
            end.cq.poll()
        except RdmaError as exc:
            out["gone"] = [exc.call, exc.errno, str(exc)]
    else:
        out["devices"] = end.verbs.devices()
        fabric.set_fault(theirs, "present", 1)

    # rank 0 re-connects on a device that wedges its port on re-connect; a reboot cures it
    _barrier("wedge")
    if me == 0:
        fabric.set_fault(mine, "wedge_on_reconnect", 1)
        info = _await("info", 1)
        end.qp.close()
        qp = end.pd.create_qp(end.cq, end.cq, 4, 4)
        qp.to_init()
        try:
            qp.to_rtr(info["qpn"], bytes.fromhex(info["gid"]), info["psn"], end.gid_index)
        except RdmaError as exc:
            out["wedged"] = [exc.call, exc.errno]
        fabric.reboot(mine)
        qp.to_rtr(info["qpn"], bytes.fromhex(info["gid"]), info["psn"], end.gid_index)
        out["after_reboot"] = "RTR"
    out["failures"] = end.verbs.provider.failures
    result(out)
    _barrier("done")
    end.close()  # also after the device vanished: what it held is freed
    fabric.close()


def qp_limit() -> Exit | None:
    """Both ranks on one device (TEST_DEVICE), limit 3: rank 1 holds three QPs and dies without closing
    anything; rank 0 is refused (EBUSY) while it lives and gets a QP once it is dead."""
    me = rank()
    cfg = Config.from_env()
    verbs = verbs_from_config(cfg)
    dev = verbs.open(os.environ["TEST_DEVICE"])
    pd = dev.alloc_pd()
    cq = dev.create_cq(8)
    if me == 1:
        held = [pd.create_qp(cq, cq, 4, 4) for _ in range(3)]
        _publish("full", [q.qp_num for q in held])
        _await("tried", 0, START_TIMEOUT)  # (rank 0 may still be starting)
        return Exit(0, hard=True)  # no clean-up: as a crash
    _await("full", 1, START_TIMEOUT)  # (rank 1 may still be starting)
    out: dict[str, Any] = {}
    try:
        pd.create_qp(cq, cq, 4, 4)
    except RdmaError as exc:
        out["while_alive"] = exc.errno
    peer_pid = int(_await("pid", 1))
    _publish("tried")
    end = time.monotonic() + TIMEOUT
    while time.monotonic() < end:
        try:
            os.kill(peer_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    out["after_death"] = pd.create_qp(cq, cq, 4, 4).qp_num
    result(out)
    dev.close()
    verbs.close()
    return None


def _publish_pid() -> None:
    _publish("pid", os.getpid())


if __name__ == "__main__":
    _publish_pid()
    main({"pingpong": pingpong, "faults": faults, "qp_limit": qp_limit})
