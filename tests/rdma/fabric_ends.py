"""Two ends of a UC connection over a fake fabric, built with the binding exactly as a link would: open the
device, PD, a registered buffer, a CQ, a UC QP, INIT -> RTR -> RTS addressed by the IPv4-mapped GIDs.
Shared by the in-process tests and the rank programs (each rank builds one end)."""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

from torch_thunderbolt.transport import verbs as v
from torch_thunderbolt.transport.providers import load_verbs

BUFFER = 1 << 20


@dataclass
class End:
    verbs: v.Verbs
    device: v.Device
    pd: v.ProtectionDomain
    buffer: bytearray
    mr: v.MemoryRegion
    cq: v.CompletionQueue
    qp: v.QueuePair
    gid_index: int
    gid: bytes
    channel: v.CompletionChannel | None = None

    @property
    def info(self) -> dict:
        return {"qpn": self.qp.qp_num, "gid": self.gid.hex(), "psn": 100 + self.qp.qp_num}

    def connect(self, peer: dict) -> None:
        """RTR towards `peer` (an `info`), then RTS."""
        self.qp.to_rtr(peer["qpn"], bytes.fromhex(peer["gid"]), peer["psn"], self.gid_index)
        self.qp.to_rts(self.info["psn"])

    def addr(self, offset: int = 0) -> int:
        return self.mr.addr + offset

    def send(self, wr_id: int, offset: int, length: int, signaled: bool = True) -> None:
        self.qp.post_send(wr_id, self.addr(offset), length, self.mr.lkey, signaled)

    def recv(self, wr_id: int, offset: int, length: int) -> None:
        self.qp.post_recv(wr_id, self.addr(offset), length, self.mr.lkey)

    def wait(self, count: int = 1, seconds: float = 5.0) -> list[tuple[int, int, int, int, int]]:
        """Completions until `count` arrived or `seconds` passed (then what there is)."""
        got: list[tuple[int, int, int, int, int]] = []
        end = time.monotonic() + seconds
        while len(got) < count and time.monotonic() < end:
            got += self.cq.completions()
            if len(got) < count:
                time.sleep(0.0005)
        return got

    def close(self) -> None:
        self.device.close()
        self.verbs.close()


def make_end(spec: str, fabric: str, device: str, channel: bool = False, cq_entries: int = 64,
             max_wr: int = 16, sge: int = 2) -> End:
    verbs = load_verbs(spec, fabric)
    dev = verbs.open(device)
    found = dev.ipv4_gid_index()
    assert found is not None, f"{device} has no IPv4-mapped GID"
    pd = dev.alloc_pd()
    buffer = bytearray(BUFFER)
    mr = pd.reg_buffer(buffer)
    ch = dev.create_comp_channel() if channel else None
    cq = dev.create_cq(cq_entries, ch)
    qp = pd.create_qp(cq, cq, max_wr, max_wr, sge, sge)
    qp.to_init()
    return End(verbs, dev, pd, buffer, mr, cq, qp, found[0], found[1], ch)


def pair(fabric: str, a: str = "rdma_fake0", b: str = "rdma_fake1", **kw: object) -> tuple[End, End]:
    """Two connected ends in this process (two providers, as two processes would have)."""
    x, y = make_end("fake", fabric, a, **kw), make_end("fake", fabric, b, **kw)  # type: ignore[arg-type]
    x.connect(y.info)
    y.connect(x.info)
    return x, y


def raw_send(end: End, opcode: int, length: int = 64) -> int:
    """Post one work request with `opcode` through the context's ops table, as verbs.h's inline does;
    the provider's return value."""
    sge = v.ibv_sge(addr=end.addr(), length=length, lkey=end.mr.lkey)
    wr = v.ibv_send_wr(wr_id=1, sg_list=ctypes.pointer(sge), num_sge=1, opcode=opcode,
                       send_flags=v.IBV_SEND_SIGNALED)
    bad = ctypes.c_void_p()
    qp = v.ibv_qp.from_address(end.qp.qp)
    post = v.POST_SEND(qp.context.contents.ops.post_send)
    return post(end.qp.qp, ctypes.addressof(wr), ctypes.addressof(bad))
