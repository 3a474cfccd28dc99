"""The binding's ctypes structures have rdma-core's layout.

Two checks: every size and offset the binding (and the fake provider) relies on, against numbers written
down from rdma-core's `libibverbs/verbs.h` (v44.0 as Debian's libibverbs-dev 44.0-2 ships it, LP64; the
facts note finds Apple's SDK header equal on these), and, where a C compiler and that header are installed
(`apt-get install libibverbs-dev`), every field of every structure against a compiled program's
`offsetof`/`sizeof`. Members after the first pthread field of ibv_context/ibv_cq/ibv_qp depend on the C
library's pthread sizes, so their numbers are only compared with the compiler's.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from torch_thunderbolt.transport import verbs as v

HEADER = Path("/usr/include/infiniband/verbs.h")

# rdma-core verbs.h (LP64): sizes.
SIZES = {
    "union ibv_gid": 16, "struct ibv_device": 664, "struct ibv_context_ops": 256, "struct ibv_device_attr": 232,
    "struct ibv_port_attr": 52, "struct ibv_pd": 16, "struct ibv_mr": 48, "struct ibv_comp_channel": 16,
    "struct ibv_qp_cap": 20, "struct ibv_qp_init_attr": 64, "struct ibv_global_route": 24,
    "struct ibv_ah_attr": 32, "struct ibv_qp_attr": 144, "struct ibv_sge": 16, "struct ibv_send_wr": 128,
    "struct ibv_recv_wr": 32, "struct ibv_wc": 48,
}

# rdma-core verbs.h (LP64): the offsets used (by the binding's hot path, its set-up and the fake).
OFFSETS = {
    "struct ibv_device": {"name": 24, "dev_name": 88, "dev_path": 152, "ibdev_path": 408},
    "struct ibv_context": {"device": 0, "ops": 8, "cmd_fd": 264, "async_fd": 268, "num_comp_vectors": 272,
                           "mutex": 280},
    # The inline data path: ctx->ops.poll_cq, .req_notify_cq, .post_send, .post_recv.
    "struct ibv_context_ops": {"poll_cq": 88, "req_notify_cq": 96, "post_send": 200, "post_recv": 208},
    "struct ibv_pd": {"context": 0, "handle": 8},
    "struct ibv_mr": {"context": 0, "pd": 8, "addr": 16, "length": 24, "handle": 32, "lkey": 36, "rkey": 40},
    "struct ibv_comp_channel": {"context": 0, "fd": 8, "refcnt": 12},
    "struct ibv_cq": {"context": 0, "channel": 8, "cq_context": 16, "handle": 24, "cqe": 28, "mutex": 32},
    "struct ibv_qp": {"context": 0, "qp_context": 8, "pd": 16, "send_cq": 24, "recv_cq": 32, "srq": 40,
                      "handle": 48, "qp_num": 52, "state": 56, "qp_type": 60, "mutex": 64},
    "struct ibv_port_attr": {"state": 0, "max_mtu": 4, "active_mtu": 8, "gid_tbl_len": 12, "max_msg_sz": 20,
                             "lid": 34, "link_layer": 46},
    "struct ibv_device_attr": {"fw_ver": 0, "max_qp": 108, "max_qp_wr": 112, "max_sge": 120, "max_cq": 128,
                               "max_cqe": 132, "max_mr": 136, "max_pd": 140, "phys_port_cnt": 227},
    "struct ibv_qp_cap": {"max_send_wr": 0, "max_recv_wr": 4, "max_send_sge": 8, "max_recv_sge": 12,
                          "max_inline_data": 16},
    "struct ibv_qp_init_attr": {"qp_context": 0, "send_cq": 8, "recv_cq": 16, "srq": 24, "cap": 32,
                                "qp_type": 52, "sq_sig_all": 56},
    "struct ibv_global_route": {"dgid": 0, "flow_label": 16, "sgid_index": 20, "hop_limit": 21,
                                "traffic_class": 22},
    "struct ibv_ah_attr": {"grh": 0, "dlid": 24, "sl": 26, "src_path_bits": 27, "static_rate": 28,
                           "is_global": 29, "port_num": 30},
    "struct ibv_qp_attr": {"qp_state": 0, "cur_qp_state": 4, "path_mtu": 8, "qkey": 16, "rq_psn": 20,
                           "sq_psn": 24, "dest_qp_num": 28, "qp_access_flags": 32, "cap": 36, "ah_attr": 56,
                           "alt_ah_attr": 88, "pkey_index": 120, "port_num": 129, "timeout": 130,
                           "rate_limit": 136},
    "struct ibv_sge": {"addr": 0, "length": 8, "lkey": 12},
    "struct ibv_send_wr": {"wr_id": 0, "next": 8, "sg_list": 16, "num_sge": 24, "opcode": 28, "send_flags": 32,
                           "imm_data": 36, "wr": 40, "qp_type": 72, "bind_mw": 80, "tso": 80},
    "struct ibv_recv_wr": {"wr_id": 0, "next": 8, "sg_list": 16, "num_sge": 24},
    "struct ibv_wc": {"wr_id": 0, "status": 8, "opcode": 12, "vendor_err": 16, "byte_len": 20, "imm_data": 24,
                      "qp_num": 28, "src_qp": 32, "wc_flags": 36, "pkey_index": 40, "slid": 42, "sl": 44,
                      "dlid_path_bits": 45},
}

# rdma-core verbs.h enum values the binding uses.
CONSTANTS = {
    "IBV_QPT_RC": 2, "IBV_QPT_UC": 3, "IBV_QPS_RESET": 0, "IBV_QPS_INIT": 1, "IBV_QPS_RTR": 2, "IBV_QPS_RTS": 3,
    "IBV_QPS_ERR": 6, "IBV_MTU_1024": 3, "IBV_PORT_DOWN": 1, "IBV_PORT_ACTIVE": 4, "IBV_ACCESS_LOCAL_WRITE": 1,
    "IBV_ACCESS_REMOTE_WRITE": 2, "IBV_ACCESS_REMOTE_READ": 4, "IBV_QP_STATE": 1, "IBV_QP_ACCESS_FLAGS": 8,
    "IBV_QP_PKEY_INDEX": 16, "IBV_QP_PORT": 32, "IBV_QP_AV": 128, "IBV_QP_PATH_MTU": 256, "IBV_QP_RQ_PSN": 4096,
    "IBV_QP_SQ_PSN": 65536, "IBV_QP_DEST_QPN": 1 << 20, "IBV_WR_SEND": 2, "IBV_SEND_SIGNALED": 2,
    "IBV_WC_SUCCESS": 0, "IBV_WC_LOC_LEN_ERR": 1, "IBV_WC_LOC_PROT_ERR": 4, "IBV_WC_WR_FLUSH_ERR": 5,
    "IBV_WC_GENERAL_ERR": 21, "IBV_WC_SEND": 0, "IBV_WC_RECV": 128,
}


def _fields(cls: type, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(C member path, offset) of every member, anonymous unions flattened as C names them."""
    anonymous = set(getattr(cls, "_anonymous_", ()))
    for name, typ, *_ in cls._fields_:
        off = getattr(cls, name).offset
        if name in anonymous:
            yield from ((p, off + o) for p, o in _fields(typ, prefix))
            continue
        yield prefix + name, off
        if isinstance(typ, type) and issubclass(typ, (ctypes.Structure, ctypes.Union)):
            yield from ((p, off + o) for p, o in _fields(typ, f"{prefix}{name}."))


def _python_layout() -> dict[tuple[str, str], int]:
    out = {}
    for cname, cls in v.STRUCTURES.items():
        out[(cname, "sizeof")] = ctypes.sizeof(cls)
        out.update({(cname, path): off for path, off in _fields(cls)})
    return out


def test_sizes_match_rdma_core() -> None:
    got = {name: ctypes.sizeof(v.STRUCTURES[name]) for name in SIZES}
    assert got == SIZES


def test_offsets_match_rdma_core() -> None:
    layout = _python_layout()
    got = {s: {f: layout[(s, f)] for f in fields} for s, fields in OFFSETS.items()}
    assert got == OFFSETS


def test_constants_match_rdma_core() -> None:
    assert {name: getattr(v, name) for name in CONSTANTS} == CONSTANTS


def test_hot_path_formats_agree_with_the_structures() -> None:
    """The struct formats the hot path packs with sit where the ctypes fields are."""
    wr = v.ibv_send_wr()
    wr.wr_id = 0x1122334455667788
    v.SEND_WR_TAIL.pack_into(wr, 24, 3, v.IBV_WR_SEND, v.IBV_SEND_SIGNALED)
    assert (wr.wr_id, wr.num_sge, wr.opcode, wr.send_flags) == (0x1122334455667788, 3, v.IBV_WR_SEND,
                                                              v.IBV_SEND_SIGNALED)
    sge = v.ibv_sge()
    v.SGE.pack_into(sge, 0, 1 << 40, 4096, 77)
    assert (sge.addr, sge.length, sge.lkey) == (1 << 40, 4096, 77)
    wc = v.ibv_wc(wr_id=5, status=1, opcode=v.IBV_WC_RECV, vendor_err=2, byte_len=100, imm_data=3, qp_num=9,
                  src_qp=10)
    assert v.WC.unpack_from(wc, 0) == (5, 1, v.IBV_WC_RECV, 2, 100, 3, 9, 10)
    assert v.WC_BYTES == ctypes.sizeof(v.ibv_wc)


def _c_program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <infiniband/verbs.h>", "int main(void) {"]
    for (cname, path) in _python_layout():
        expr = f"sizeof({cname})" if path == "sizeof" else f"offsetof({cname}, {path})"
        lines.append(f'  printf("%s|%s|%zu\\n", "{cname}", "{path}", (size_t)({expr}));')
    for name in CONSTANTS:
        lines.append(f'  printf("const|%s|%lld\\n", "{name}", (long long)({name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")
@pytest.mark.skipif(not HEADER.exists(), reason="rdma-core's headers are not installed "
                                                "(Debian: apt-get install libibverbs-dev)")
def test_every_field_matches_the_compiled_header(tmp_path: Path) -> None:
    src = tmp_path / "layout.c"
    src.write_text(_c_program())
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=gnu11", "-o", str(exe), str(src)], check=True, capture_output=True, timeout=60)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    c_layout, c_consts = {}, {}
    for line in out.splitlines():
        a, b, value = line.split("|")
        if a == "const":
            c_consts[b] = int(value)
        else:
            c_layout[(a, b)] = int(value)
    py = _python_layout()
    assert len(c_layout) == len(py) > 300  # every member of every structure, nested ones included
    assert {k: py[k] for k in c_layout} == c_layout
    assert c_consts == CONSTANTS
