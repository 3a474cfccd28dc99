"""The ibverbs API in Python (ctypes, no compiler): the structures, the constants, the control path loaded
from the provider's library and the data path read from the context's ops table, as the header does.

Sources (read, not copied): rdma-core's `libibverbs/verbs.h` (v44.0, as Debian's libibverbs-dev 44.0-2
ships it; Apple's SDK header has the same layouts, see tests/rdma/test_verbs_layout.py); MLX's JACCL
(`mlx/distributed/jaccl/lib/jaccl/rdma.{h,cpp}`: the symbols loaded from librdma.dylib, the UC set-up);
llama.cpp's `ggml/src/ggml-rpc/transport-apple.cpp` (Apple's rules, quoted where used).

What is where:
- Structures carry the C names (`ibv_sge`, `ibv_send_wr`, `ibv_wc`, ...) and C field names (`wr_id`,
  `sg_list`, `qp_num`, ...), so they can be held against the header; constants too (`IBV_QPT_UC`, ...).
- A *provider* is where the functions come from: `NativeProvider` dlopens `librdma.dylib` (macOS 26.2+) or
  `libibverbs.so.1` (Linux, rdma-core); `testing/fake_verbs/` is a provider in Python for tests (it
  builds the same contexts and ops tables out of ctypes callbacks). Everything above the provider is the
  same code for both: `Verbs` makes a foreign function of each symbol's address with the prototypes below.
- The data path (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) is `static inline`
  in verbs.h (`qp->context->ops.post_send(...)`), exported by no library, on Linux either: `QueuePair`
  and `CompletionQueue` read those pointers from the object's own context once and call them.
- The hot path (`post_send`, `post_recv`, `poll`) reuses structures allocated once per queue pair or
  completion queue and writes them with one `struct.pack_into` each: every Python step there costs
  latency on a link whose wire takes ~4 µs.
- Errors: every failed call goes through `_fail`, the one place that turns an errno into an `RdmaError`
  naming the call, the device and what to do about it.

Not thread-safe: a device and what hangs off it are used under one lock (the transport engine's).
"""
from __future__ import annotations

import ctypes
import errno as _errno
import ipaddress
import os
import struct
from ctypes import (CFUNCTYPE, POINTER, Structure, Union, c_char, c_int, c_size_t, c_uint, c_uint8, c_uint16,
                    c_uint32, c_uint64, c_void_p, sizeof)
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..errors import RdmaError
from ..platform import Platform, current

# --- constants (verbs.h enums) -------------------------------------------------------------------------

IBV_SYSFS_NAME_MAX = 64
IBV_SYSFS_PATH_MAX = 256

# enum ibv_qp_type
IBV_QPT_RC = 2
IBV_QPT_UC = 3
IBV_QPT_UD = 4

# enum ibv_qp_state
IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE, IBV_QPS_ERR = range(7)
QP_STATE_NAMES = ("RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR")

# enum ibv_mtu
IBV_MTU_256, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096 = 1, 2, 3, 4, 5


def mtu_bytes(mtu: int) -> int:
    """An `enum ibv_mtu` value in bytes (IBV_MTU_1024 -> 1024)."""
    return 128 << mtu if IBV_MTU_256 <= mtu <= IBV_MTU_4096 else 0


# enum ibv_port_state
IBV_PORT_NOP, IBV_PORT_DOWN, IBV_PORT_INIT, IBV_PORT_ARMED, IBV_PORT_ACTIVE, IBV_PORT_ACTIVE_DEFER = range(6)
PORT_STATE_NAMES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")

# link layer (port_attr.link_layer)
IBV_LINK_LAYER_UNSPECIFIED, IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET = 0, 1, 2

# enum ibv_access_flags
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 1 << 1
IBV_ACCESS_REMOTE_READ = 1 << 2
# Apple's provider refuses LOCAL_WRITE-only regions even for SEND/RECV (llama.cpp transport-apple.cpp);
# JACCL and llama.cpp register with these three, so do we.
DEFAULT_ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE

# enum ibv_qp_attr_mask
IBV_QP_STATE = 1 << 0
IBV_QP_CUR_STATE = 1 << 1
IBV_QP_ACCESS_FLAGS = 1 << 3
IBV_QP_PKEY_INDEX = 1 << 4
IBV_QP_PORT = 1 << 5
IBV_QP_QKEY = 1 << 6
IBV_QP_AV = 1 << 7
IBV_QP_PATH_MTU = 1 << 8
IBV_QP_TIMEOUT = 1 << 9
IBV_QP_RETRY_CNT = 1 << 10
IBV_QP_RNR_RETRY = 1 << 11
IBV_QP_RQ_PSN = 1 << 12
IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
IBV_QP_MIN_RNR_TIMER = 1 << 15
IBV_QP_SQ_PSN = 1 << 16
IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
IBV_QP_CAP = 1 << 19
IBV_QP_DEST_QPN = 1 << 20
# The masks a UC queue pair's transitions need (what JACCL and llama.cpp pass; UC has no timeout, retry
# or RDMA-read attributes).
INIT_MASK = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
RTR_MASK = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN
RTS_MASK = IBV_QP_STATE | IBV_QP_SQ_PSN

# enum ibv_wr_opcode
IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_READ = range(5)

# enum ibv_send_flags
IBV_SEND_FENCE = 1 << 0
IBV_SEND_SIGNALED = 1 << 1
IBV_SEND_SOLICITED = 1 << 2
IBV_SEND_INLINE = 1 << 3

# enum ibv_wc_status
IBV_WC_STATUS_NAMES = (
    "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
    "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR", "REM_OP_ERR",
    "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR",
    "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR", "GENERAL_ERR", "TM_ERR",
    "TM_RNDV_INCOMPLETE")
(IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_QP_OP_ERR, _, IBV_WC_LOC_PROT_ERR,
 IBV_WC_WR_FLUSH_ERR) = range(6)
IBV_WC_GENERAL_ERR = 21

# enum ibv_wc_opcode
IBV_WC_SEND = 0
IBV_WC_RDMA_WRITE = 1
IBV_WC_RECV = 1 << 7


def wc_status_name(status: int) -> str:
    return IBV_WC_STATUS_NAMES[status] if 0 <= status < len(IBV_WC_STATUS_NAMES) else f"status {status}"


# --- structures (verbs.h; LP64) ------------------------------------------------------------------------
# Fields up to the first pthread member are all this module reads of the objects a provider allocates
# (ibv_context, ibv_qp, ibv_cq); the pthread members' sizes differ by system and are only needed by a
# provider that allocates those objects itself (the fake fabric, testing/fake_verbs), so they come from
# `pthread_sizes`.

def pthread_sizes(plat: Platform | None = None) -> tuple[int, int]:
    """(sizeof(pthread_mutex_t), sizeof(pthread_cond_t)) on `plat`: macOS arm64 64/48 (libSystem's
    _opaque_pthread_mutex_t: a long and 56 bytes; cond: a long and 40), glibc x86_64 40/48, glibc aarch64
    48/48."""
    plat = plat or current()
    if plat.name == "darwin":
        return 64, 48
    return (48, 48) if plat.is_arm64 else (40, 48)


_MUTEX_BYTES, _COND_BYTES = pthread_sizes()
# Opaque, but aligned as the C types are (to 8: they hold a long or pointers).
_mutex = c_uint64 * (_MUTEX_BYTES // 8)
_cond = c_uint64 * (_COND_BYTES // 8)


class _global(Structure):
    _fields_ = [("subnet_prefix", c_uint64), ("interface_id", c_uint64)]  # __be64 both


class ibv_gid(Union):
    _fields_ = [("raw", c_uint8 * 16), ("global", _global)]  # `global` is a Python keyword: getattr


class ibv_device(Structure):
    _fields_ = [("_ops", c_void_p * 2),  # struct _ibv_device_ops: two obsolete function pointers
                ("node_type", c_int), ("transport_type", c_int),
                ("name", c_char * IBV_SYSFS_NAME_MAX), ("dev_name", c_char * IBV_SYSFS_NAME_MAX),
                ("dev_path", c_char * IBV_SYSFS_PATH_MAX), ("ibdev_path", c_char * IBV_SYSFS_PATH_MAX)]


# struct ibv_context_ops: every member is a function pointer; the four the data path uses are typed by
# the prototypes below when read. Order and names as in verbs.h.
CONTEXT_OPS = (
    "_compat_query_device", "_compat_query_port", "_compat_alloc_pd", "_compat_dealloc_pd", "_compat_reg_mr",
    "_compat_rereg_mr", "_compat_dereg_mr", "alloc_mw", "bind_mw", "dealloc_mw", "_compat_create_cq",
    "poll_cq", "req_notify_cq", "_compat_cq_event", "_compat_resize_cq", "_compat_destroy_cq",
    "_compat_create_srq", "_compat_modify_srq", "_compat_query_srq", "_compat_destroy_srq", "post_srq_recv",
    "_compat_create_qp", "_compat_query_qp", "_compat_modify_qp", "_compat_destroy_qp", "post_send",
    "post_recv", "_compat_create_ah", "_compat_destroy_ah", "_compat_attach_mcast", "_compat_detach_mcast",
    "_compat_async_event")


class ibv_context_ops(Structure):
    _fields_ = [(name, c_void_p) for name in CONTEXT_OPS]


class ibv_context(Structure):
    _fields_ = [("device", POINTER(ibv_device)), ("ops", ibv_context_ops), ("cmd_fd", c_int),
                ("async_fd", c_int), ("num_comp_vectors", c_int), ("mutex", _mutex),
                ("abi_compat", c_void_p)]


class ibv_device_attr(Structure):
    _fields_ = [("fw_ver", c_char * 64), ("node_guid", c_uint64), ("sys_image_guid", c_uint64),
                ("max_mr_size", c_uint64), ("page_size_cap", c_uint64), ("vendor_id", c_uint32),
                ("vendor_part_id", c_uint32), ("hw_ver", c_uint32), ("max_qp", c_int), ("max_qp_wr", c_int),
                ("device_cap_flags", c_uint), ("max_sge", c_int), ("max_sge_rd", c_int), ("max_cq", c_int),
                ("max_cqe", c_int), ("max_mr", c_int), ("max_pd", c_int), ("max_qp_rd_atom", c_int),
                ("max_ee_rd_atom", c_int), ("max_res_rd_atom", c_int), ("max_qp_init_rd_atom", c_int),
                ("max_ee_init_rd_atom", c_int), ("atomic_cap", c_int), ("max_ee", c_int), ("max_rdd", c_int),
                ("max_mw", c_int), ("max_raw_ipv6_qp", c_int), ("max_raw_ethy_qp", c_int),
                ("max_mcast_grp", c_int), ("max_mcast_qp_attach", c_int), ("max_total_mcast_qp_attach", c_int),
                ("max_ah", c_int), ("max_fmr", c_int), ("max_map_per_fmr", c_int), ("max_srq", c_int),
                ("max_srq_wr", c_int), ("max_srq_sge", c_int), ("max_pkeys", c_uint16),
                ("local_ca_ack_delay", c_uint8), ("phys_port_cnt", c_uint8)]


class ibv_port_attr(Structure):
    _fields_ = [("state", c_int), ("max_mtu", c_int), ("active_mtu", c_int), ("gid_tbl_len", c_int),
                ("port_cap_flags", c_uint32), ("max_msg_sz", c_uint32), ("bad_pkey_cntr", c_uint32),
                ("qkey_viol_cntr", c_uint32), ("pkey_tbl_len", c_uint16), ("lid", c_uint16),
                ("sm_lid", c_uint16), ("lmc", c_uint8), ("max_vl_num", c_uint8), ("sm_sl", c_uint8),
                ("subnet_timeout", c_uint8), ("init_type_reply", c_uint8), ("active_width", c_uint8),
                ("active_speed", c_uint8), ("phys_state", c_uint8), ("link_layer", c_uint8), ("flags", c_uint8),
                ("port_cap_flags2", c_uint16)]


class ibv_pd(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("handle", c_uint32)]


class ibv_mr(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("pd", POINTER(ibv_pd)), ("addr", c_void_p),
                ("length", c_size_t), ("handle", c_uint32), ("lkey", c_uint32), ("rkey", c_uint32)]


class ibv_comp_channel(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("fd", c_int), ("refcnt", c_int)]


class ibv_cq(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("channel", POINTER(ibv_comp_channel)),
                ("cq_context", c_void_p), ("handle", c_uint32), ("cqe", c_int),
                ("mutex", _mutex), ("cond", _cond),
                ("comp_events_completed", c_uint32), ("async_events_completed", c_uint32)]


class ibv_qp(Structure):
    _fields_ = [("context", POINTER(ibv_context)), ("qp_context", c_void_p), ("pd", POINTER(ibv_pd)),
                ("send_cq", POINTER(ibv_cq)), ("recv_cq", POINTER(ibv_cq)), ("srq", c_void_p),
                ("handle", c_uint32), ("qp_num", c_uint32), ("state", c_int), ("qp_type", c_int),
                ("mutex", _mutex), ("cond", _cond),
                ("events_completed", c_uint32)]


class ibv_qp_cap(Structure):
    _fields_ = [("max_send_wr", c_uint32), ("max_recv_wr", c_uint32), ("max_send_sge", c_uint32),
                ("max_recv_sge", c_uint32), ("max_inline_data", c_uint32)]


class ibv_qp_init_attr(Structure):
    _fields_ = [("qp_context", c_void_p), ("send_cq", POINTER(ibv_cq)), ("recv_cq", POINTER(ibv_cq)),
                ("srq", c_void_p), ("cap", ibv_qp_cap), ("qp_type", c_int), ("sq_sig_all", c_int)]


class ibv_global_route(Structure):
    _fields_ = [("dgid", ibv_gid), ("flow_label", c_uint32), ("sgid_index", c_uint8), ("hop_limit", c_uint8),
                ("traffic_class", c_uint8)]


class ibv_ah_attr(Structure):
    _fields_ = [("grh", ibv_global_route), ("dlid", c_uint16), ("sl", c_uint8), ("src_path_bits", c_uint8),
                ("static_rate", c_uint8), ("is_global", c_uint8), ("port_num", c_uint8)]


class ibv_qp_attr(Structure):
    _fields_ = [("qp_state", c_int), ("cur_qp_state", c_int), ("path_mtu", c_int), ("path_mig_state", c_int),
                ("qkey", c_uint32), ("rq_psn", c_uint32), ("sq_psn", c_uint32), ("dest_qp_num", c_uint32),
                ("qp_access_flags", c_uint), ("cap", ibv_qp_cap), ("ah_attr", ibv_ah_attr),
                ("alt_ah_attr", ibv_ah_attr), ("pkey_index", c_uint16), ("alt_pkey_index", c_uint16),
                ("en_sqd_async_notify", c_uint8), ("sq_draining", c_uint8), ("max_rd_atomic", c_uint8),
                ("max_dest_rd_atomic", c_uint8), ("min_rnr_timer", c_uint8), ("port_num", c_uint8),
                ("timeout", c_uint8), ("retry_cnt", c_uint8), ("rnr_retry", c_uint8), ("alt_port_num", c_uint8),
                ("alt_timeout", c_uint8), ("rate_limit", c_uint32)]


class ibv_sge(Structure):
    _fields_ = [("addr", c_uint64), ("length", c_uint32), ("lkey", c_uint32)]


class _rdma(Structure):
    _fields_ = [("remote_addr", c_uint64), ("rkey", c_uint32)]


class _atomic(Structure):
    _fields_ = [("remote_addr", c_uint64), ("compare_add", c_uint64), ("swap", c_uint64), ("rkey", c_uint32)]


class _ud(Structure):
    _fields_ = [("ah", c_void_p), ("remote_qpn", c_uint32), ("remote_qkey", c_uint32)]


class _wr(Union):
    _fields_ = [("rdma", _rdma), ("atomic", _atomic), ("ud", _ud)]


class _xrc(Structure):
    _fields_ = [("remote_srqn", c_uint32)]


class _qp_type(Union):
    _fields_ = [("xrc", _xrc)]


class ibv_mw_bind_info(Structure):
    _fields_ = [("mr", c_void_p), ("addr", c_uint64), ("length", c_uint64), ("mw_access_flags", c_uint)]


class _bind_mw(Structure):
    _fields_ = [("mw", c_void_p), ("rkey", c_uint32), ("bind_info", ibv_mw_bind_info)]


class _tso(Structure):
    _fields_ = [("hdr", c_void_p), ("hdr_sz", c_uint16), ("mss", c_uint16)]


class _imm(Union):  # anonymous in C
    _fields_ = [("imm_data", c_uint32), ("invalidate_rkey", c_uint32)]


class _ext(Union):  # anonymous in C
    _fields_ = [("bind_mw", _bind_mw), ("tso", _tso)]


class ibv_send_wr(Structure):
    pass


ibv_send_wr._anonymous_ = ("_u_imm", "_u_ext")
ibv_send_wr._fields_ = [("wr_id", c_uint64), ("next", POINTER(ibv_send_wr)), ("sg_list", POINTER(ibv_sge)),
                        ("num_sge", c_int), ("opcode", c_int), ("send_flags", c_uint), ("_u_imm", _imm),
                        ("wr", _wr), ("qp_type", _qp_type), ("_u_ext", _ext)]


class ibv_recv_wr(Structure):
    pass


ibv_recv_wr._fields_ = [("wr_id", c_uint64), ("next", POINTER(ibv_recv_wr)), ("sg_list", POINTER(ibv_sge)),
                        ("num_sge", c_int)]


class _wc_imm(Union):  # anonymous in C
    _fields_ = [("imm_data", c_uint32), ("invalidated_rkey", c_uint32)]


class ibv_wc(Structure):
    _anonymous_ = ("_u_imm",)
    _fields_ = [("wr_id", c_uint64), ("status", c_int), ("opcode", c_int), ("vendor_err", c_uint32),
                ("byte_len", c_uint32), ("_u_imm", _wc_imm), ("qp_num", c_uint32), ("src_qp", c_uint32),
                ("wc_flags", c_uint), ("pkey_index", c_uint16), ("slid", c_uint16), ("sl", c_uint8),
                ("dlid_path_bits", c_uint8)]


# The structures the tests pin to rdma-core's layout (name -> class), and the C header's name of each.
STRUCTURES: dict[str, type] = {
    "union ibv_gid": ibv_gid, "struct ibv_device": ibv_device, "struct ibv_context_ops": ibv_context_ops,
    "struct ibv_context": ibv_context, "struct ibv_device_attr": ibv_device_attr,
    "struct ibv_port_attr": ibv_port_attr, "struct ibv_pd": ibv_pd, "struct ibv_mr": ibv_mr,
    "struct ibv_comp_channel": ibv_comp_channel, "struct ibv_cq": ibv_cq, "struct ibv_qp": ibv_qp,
    "struct ibv_qp_cap": ibv_qp_cap, "struct ibv_qp_init_attr": ibv_qp_init_attr,
    "struct ibv_global_route": ibv_global_route, "struct ibv_ah_attr": ibv_ah_attr,
    "struct ibv_qp_attr": ibv_qp_attr, "struct ibv_sge": ibv_sge, "struct ibv_send_wr": ibv_send_wr,
    "struct ibv_recv_wr": ibv_recv_wr, "struct ibv_wc": ibv_wc}

# The hot path writes and reads these with struct instead of ctypes attributes (one call, not one per
# field; wr_id is a single attribute store). Offsets from the layouts above (pinned by the tests):
# ibv_sge {addr, length, lkey}; ibv_send_wr: num_sge @24, opcode @28, send_flags @32;
# ibv_wc: wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp @0..35.
SGE = struct.Struct("<QII")
_pack_sge = SGE.pack_into
SEND_WR_TAIL = struct.Struct("<iiI")  # num_sge, opcode, send_flags at 24
WC = struct.Struct("<QiiIIIII")
WC_BYTES = 48

# --- prototypes --------------------------------------------------------------------------------------
# Control path: the library's exported functions. Pointers are c_void_p (an int in Python); every one
# keeps errno (use_errno), which is how the control path reports failures (NULL or -1 plus errno).
# ibv_get_device_name returns `const char *`: c_void_p, read with string_at, because a ctypes callback
# (the fake provider) cannot return c_char_p memory safely.
_P = c_void_p
CONTROL_PROTOTYPES: dict[str, Any] = {
    "ibv_get_device_list": CFUNCTYPE(_P, POINTER(c_int), use_errno=True),
    "ibv_free_device_list": CFUNCTYPE(None, _P, use_errno=True),
    "ibv_get_device_name": CFUNCTYPE(_P, _P, use_errno=True),
    "ibv_open_device": CFUNCTYPE(_P, _P, use_errno=True),
    "ibv_close_device": CFUNCTYPE(c_int, _P, use_errno=True),
    "ibv_query_device": CFUNCTYPE(c_int, _P, _P, use_errno=True),
    # The exported symbol behind verbs.h's ibv_query_port macro; it writes the leading (compat) part of
    # ibv_port_attr, which is why the struct is zeroed first, as the header's inline does.
    "ibv_query_port": CFUNCTYPE(c_int, _P, c_uint8, _P, use_errno=True),
    "ibv_query_gid": CFUNCTYPE(c_int, _P, c_uint8, c_int, _P, use_errno=True),
    "ibv_alloc_pd": CFUNCTYPE(_P, _P, use_errno=True),
    "ibv_dealloc_pd": CFUNCTYPE(c_int, _P, use_errno=True),
    "ibv_reg_mr": CFUNCTYPE(_P, _P, _P, c_size_t, c_int, use_errno=True),
    "ibv_dereg_mr": CFUNCTYPE(c_int, _P, use_errno=True),
    "ibv_create_comp_channel": CFUNCTYPE(_P, _P, use_errno=True),
    "ibv_destroy_comp_channel": CFUNCTYPE(c_int, _P, use_errno=True),
    "ibv_create_cq": CFUNCTYPE(_P, _P, c_int, _P, _P, c_int, use_errno=True),
    "ibv_destroy_cq": CFUNCTYPE(c_int, _P, use_errno=True),
    "ibv_get_cq_event": CFUNCTYPE(c_int, _P, _P, _P, use_errno=True),
    "ibv_ack_cq_events": CFUNCTYPE(None, _P, c_uint, use_errno=True),
    "ibv_create_qp": CFUNCTYPE(_P, _P, _P, use_errno=True),
    "ibv_modify_qp": CFUNCTYPE(c_int, _P, _P, c_int, use_errno=True),
    "ibv_destroy_qp": CFUNCTYPE(c_int, _P, use_errno=True),
}
# JACCL loads exactly these from librdma.dylib; the rest are optional (tmc/apple finds the completion
# channel calls exported too; whether Apple's provider ever signals a channel is not known).
REQUIRED_SYMBOLS = ("ibv_get_device_list", "ibv_free_device_list", "ibv_get_device_name", "ibv_open_device",
                    "ibv_close_device", "ibv_alloc_pd", "ibv_dealloc_pd", "ibv_reg_mr", "ibv_dereg_mr",
                    "ibv_create_cq", "ibv_destroy_cq", "ibv_create_qp", "ibv_modify_qp", "ibv_destroy_qp",
                    "ibv_query_port", "ibv_query_gid")

# Data path: members of ibv_context_ops. They return an errno value (rdma-core: positive; Apple's provider
# was seen returning it negated, `ibv_post_recv ... ret=-12` in hellas-ai/thunderbolt-ibverbs PR #35), or
# for poll_cq the number of completions (negative on error); no errno, so no use_errno cost per call.
POLL_CQ = CFUNCTYPE(c_int, _P, c_int, _P)
REQ_NOTIFY_CQ = CFUNCTYPE(c_int, _P, c_int)
POST_SEND = CFUNCTYPE(c_int, _P, _P, _P)
POST_RECV = CFUNCTYPE(c_int, _P, _P, _P)
DATA_PROTOTYPES: dict[str, Any] = {"poll_cq": POLL_CQ, "req_notify_cq": REQ_NOTIFY_CQ, "post_send": POST_SEND,
                                   "post_recv": POST_RECV}

# --- errors: the one place an errno becomes an RdmaError ----------------------------------------------

# (call, errno) first, then errno alone: what it means here and what to do. Figures from others'
# measurements on Apple's provider (rdma-tb5-facts: mlx #3162 / PR #4209 for QPs and MRs, hellas-ai PRs
# #35/#39 for receive depth, tmc/apple and exo #1712 for wedged ports).
_HINTS: dict[tuple[str, int] | int, str] = {
    ("ibv_create_qp", _errno.EBUSY): "no free queue pair on this device: Apple's provider allows about 10 per "
                                     "device; another RDMA job (MLX/JACCL, exo) may hold some, or use fewer "
                                     "peers per cable",
    ("ibv_create_qp", _errno.EOPNOTSUPP): "only unreliable-connected (UC) queue pairs are supported by Apple's "
                                          "provider",
    ("ibv_reg_mr", _errno.ENOMEM): "no free memory region: Apple's provider allows about 100 per device; "
                                   "register fewer, larger buffers",
    ("ibv_post_recv", _errno.ENOMEM): "receive queue full: post at most the queue pair's max_recv_wr "
                                      "(about 32 outstanding receives are safe on Apple's provider)",
    ("ibv_post_send", _errno.ENOMEM): "send queue full: poll completions before posting more than max_send_wr",
    ("ibv_post_recv", _errno.EINVAL): "Apple's provider takes receives only once the queue pair is RTS, of "
                                      "4 KiB x 2^k bytes",
    ("ibv_modify_qp", _errno.ETIMEDOUT): "the port may be wedged after a failed set-up (a known fault of "
                                         "Apple's provider): reboot this Mac",
    ("ibv_query_port", _errno.ETIMEDOUT): "the port may be wedged after a failed set-up (a known fault of "
                                          "Apple's provider): reboot this Mac",
    ("ibv_modify_qp", _errno.EINVAL): "check the port (1), the GID index (the IPv4-mapped GID's), the path "
                                      "MTU (1024) and the transition order INIT, RTR, RTS",
    ("ibv_modify_qp", _errno.ENETDOWN): "the port is down: check the Thunderbolt cable",
    ("ibv_get_device_list", _errno.ENOSYS): "this kernel has no RDMA support",
    ("ibv_create_comp_channel", _errno.EOPNOTSUPP): "the provider has no completion channels: poll instead",
    ("ibv_create_comp_channel", _errno.ENOSYS): "the provider has no completion channels: poll instead",
    ("poll_cq", _errno.EOVERFLOW): "completion queue overrun: make it hold every outstanding send and receive",
    _errno.ENODEV: "the RDMA device is gone (cable unplugged or Thunderbolt interface removed)",
    _errno.EPERM: "RDMA is not enabled: run `rdma_ctl enable` in Recovery (Thunderbolt 5 Macs, macOS 26.2+)",
    _errno.EACCES: "RDMA is not enabled: run `rdma_ctl enable` in Recovery (Thunderbolt 5 Macs, macOS 26.2+)",
    _errno.EBUSY: "the device is busy: resources may be exhausted; Apple's provider may need a reboot",
}


def _fail(call: str, device: str, err: int, detail: str = "") -> RdmaError:
    """The error for `call` on `device` failing with `err` (an errno value, either sign; 0 = unknown)."""
    err = abs(err)
    hint = _HINTS.get((call, err)) or _HINTS.get(err, "")
    what = os.strerror(err) if err else "failed without an errno"
    where = f" on {device}" if device else ""
    text = f"{call}{where} failed: {what}" + (f" ({detail})" if detail else "") + (f"; {hint}" if hint else "")
    return RdmaError(text, call=call, device=device, errno=err)


def _status(rc: int) -> int:
    """The errno of a control call's nonzero int result: the value itself (rdma-core returns errno; some
    calls return -1 and set errno)."""
    return ctypes.get_errno() if rc == -1 else rc


# --- providers ----------------------------------------------------------------------------------------

class Provider(Protocol):
    """Where the functions come from: `symbol(name)` is the address of a control-path function, or None."""
    name: str

    def symbol(self, name: str) -> int | None: ...

    def close(self) -> None: ...


def library_candidates(plat: Platform | None = None) -> tuple[str, ...]:
    """Where the verbs library is on `plat`: macOS 26.2+ ships librdma.dylib in the dyld shared cache (no
    file on disk, so dlopen by name; /usr/lib/librdma.dylib as llama.cpp opens it); Linux has rdma-core's
    libibverbs.so.1."""
    plat = plat or current()
    if plat.name == "darwin":
        return ("librdma.dylib", "/usr/lib/librdma.dylib")
    return ("libibverbs.so.1",)


class NativeProvider:
    """The system's verbs library."""

    def __init__(self, plat: Platform | None = None, candidates: Sequence[str] | None = None) -> None:
        tried = []
        for path in candidates or library_candidates(plat):
            try:
                self._lib = ctypes.CDLL(path, use_errno=True)
            except OSError as exc:
                tried.append(f"{path}: {exc}")
                continue
            self.name = path
            return
        raise RdmaError("no verbs library could be loaded (" + "; ".join(tried) + "); RDMA over Thunderbolt needs "
                        "macOS 26.2+ (librdma.dylib); on Linux, rdma-core's libibverbs1",
                        call="dlopen", device="", errno=_errno.ENOENT)

    def symbol(self, name: str) -> int | None:
        try:
            return ctypes.cast(getattr(self._lib, name), c_void_p).value
        except AttributeError:
            return None

    def close(self) -> None:
        pass  # a dlopened library stays loaded: other users in this process may hold its handles


# --- GIDs ---------------------------------------------------------------------------------------------

def ipv4_gid(address: str) -> bytes:
    """The IPv4-mapped GID of `address` (::ffff:a.b.c.d), as Apple's provider publishes it for an interface
    with an IPv4 address (RoCEv2 style)."""
    return ipaddress.IPv6Address("::ffff:" + str(ipaddress.IPv4Address(address))).packed


def gid_ipv4(gid: bytes) -> str | None:
    """a.b.c.d of an IPv4-mapped GID, else None."""
    mapped = ipaddress.IPv6Address(bytes(gid)).ipv4_mapped
    return str(mapped) if mapped is not None else None


def gid_text(gid: bytes) -> str:
    return str(ipaddress.IPv6Address(bytes(gid)))


# --- the binding --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PortInfo:
    port: int
    state: int  # IBV_PORT_*
    max_mtu: int  # enum ibv_mtu
    active_mtu: int
    gid_tbl_len: int
    lid: int
    link_layer: int
    max_msg_sz: int

    @property
    def active(self) -> bool:
        return self.state == IBV_PORT_ACTIVE

    @property
    def state_name(self) -> str:
        return PORT_STATE_NAMES[self.state] if 0 <= self.state < len(PORT_STATE_NAMES) else str(self.state)


@dataclass(frozen=True)
class DeviceInfo:
    """The parts of ibv_device_attr a caller needs to size things."""
    fw_ver: str
    max_qp: int
    max_qp_wr: int
    max_sge: int
    max_cq: int
    max_cqe: int
    max_mr: int
    max_pd: int
    phys_port_cnt: int


class Verbs:
    """One provider's functions. `devices()` lists device names, `open(name)` opens one."""

    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        missing = [n for n in REQUIRED_SYMBOLS if not provider.symbol(n)]
        if missing:
            raise RdmaError(f"{provider.name} lacks {', '.join(missing)}: not a verbs library",
                            call="dlsym", device="", errno=_errno.ENOSYS)
        self._fn: dict[str, Any] = {}
        for name, proto in CONTROL_PROTOTYPES.items():
            address = provider.symbol(name)
            if address:
                self._fn[name] = proto(address)

    def has(self, name: str) -> bool:
        """Whether the provider exports `name` (optional calls: ibv_query_device, completion channels)."""
        return name in self._fn

    def call(self, name: str) -> Callable[..., Any]:
        fn = self._fn.get(name)
        if fn is None:
            raise _fail(name, "", _errno.ENOSYS, f"{self.provider.name} does not export it")
        return fn

    def devices(self) -> list[str]:
        """The names of the devices the provider lists (`rdma_en2`, ...), in its order."""
        array, pointers = self._device_list()
        try:
            return [self._device_name(p) for p in pointers]
        finally:
            self.call("ibv_free_device_list")(array)

    def _device_list(self) -> tuple[int, Any]:
        count = c_int(0)
        ctypes.set_errno(0)
        array = self.call("ibv_get_device_list")(ctypes.byref(count))
        if not array:
            raise _fail("ibv_get_device_list", "", ctypes.get_errno())
        return array, (c_void_p * count.value).from_address(array)

    def _device_name(self, device: int) -> str:
        return ctypes.string_at(self.call("ibv_get_device_name")(device)).decode(errors="replace")

    def open(self, name: str) -> "Device":
        """Open the device called `name` (e.g. `rdma_en2`)."""
        array, pointers = self._device_list()
        try:
            names = [self._device_name(p) for p in pointers]
            if name not in names:
                raise RdmaError(f"no RDMA device {name} (found: {', '.join(names) or 'none'}); on a Mac the "
                                f"device of interface enX is rdma_enX", call="ibv_open_device", device=name,
                                errno=_errno.ENODEV)
            ctypes.set_errno(0)
            ctx = self.call("ibv_open_device")(pointers[names.index(name)])
            if not ctx:
                raise _fail("ibv_open_device", name, ctypes.get_errno())
        finally:
            self.call("ibv_free_device_list")(array)
        return Device(self, name, ctx)

    def close(self) -> None:
        self.provider.close()


class Device:
    """An open device context. Closing it closes everything made from it, in the order Apple's provider
    needs: queue pairs, then memory regions (llama.cpp: destroy the QP first, and without moving it to ERR,
    or the provider fails the regions' unmapping), then completion queues, channels, protection domains."""

    def __init__(self, verbs: Verbs, name: str, ctx: int) -> None:
        self.verbs = verbs
        self.name = name
        self.ctx = ctx
        self.context = ibv_context.from_address(ctx)
        self._qps: list[QueuePair] = []
        self._mrs: list[MemoryRegion] = []
        self._cqs: list[CompletionQueue] = []
        self._channels: list[CompletionChannel] = []
        self._pds: list[ProtectionDomain] = []
        self._port_attr = ibv_port_attr()
        self._gid = ibv_gid()

    def _check(self) -> None:
        if not self.ctx:
            raise RdmaError(f"{self.name} is closed", call="", device=self.name, errno=_errno.EBADF)

    def query_port(self, port: int = 1) -> PortInfo:
        self._check()
        ctypes.memset(ctypes.byref(self._port_attr), 0, sizeof(ibv_port_attr))
        ctypes.set_errno(0)
        rc = self.verbs.call("ibv_query_port")(self.ctx, port, ctypes.byref(self._port_attr))
        if rc:
            raise _fail("ibv_query_port", self.name, _status(rc), f"port {port}")
        a = self._port_attr
        return PortInfo(port, a.state, a.max_mtu, a.active_mtu, a.gid_tbl_len, a.lid, a.link_layer, a.max_msg_sz)

    def query_gid(self, index: int, port: int = 1) -> bytes:
        """GID table entry `index` of `port`: 16 bytes (all zero for an empty entry)."""
        self._check()
        ctypes.set_errno(0)
        rc = self.verbs.call("ibv_query_gid")(self.ctx, port, index, ctypes.byref(self._gid))
        if rc:
            raise _fail("ibv_query_gid", self.name, _status(rc), f"port {port}, index {index}")
        return bytes(self._gid.raw)

    def gids(self, port: int = 1) -> list[bytes]:
        return [self.query_gid(i, port) for i in range(self.query_port(port).gid_tbl_len)]

    def ipv4_gid_index(self, port: int = 1, address: str | None = None) -> tuple[int, bytes] | None:
        """(index, gid) of the first IPv4-mapped GID of `port` (or the one of `address`), None if there is
        none: Apple's provider publishes it only once the interface has an IPv4 address (JACCL's check)."""
        want = ipv4_gid(address) if address else None
        for i, gid in enumerate(self.gids(port)):
            if gid_ipv4(gid) is not None and (want is None or gid == want):
                return i, gid
        return None

    def query_device(self) -> DeviceInfo:
        self._check()
        attr = ibv_device_attr()
        ctypes.set_errno(0)
        rc = self.verbs.call("ibv_query_device")(self.ctx, ctypes.byref(attr))
        if rc:
            raise _fail("ibv_query_device", self.name, _status(rc))
        return DeviceInfo(attr.fw_ver.decode(errors="replace"), attr.max_qp, attr.max_qp_wr, attr.max_sge,
                          attr.max_cq, attr.max_cqe, attr.max_mr, attr.max_pd, attr.phys_port_cnt)

    def alloc_pd(self) -> "ProtectionDomain":
        self._check()
        ctypes.set_errno(0)
        pd = self.verbs.call("ibv_alloc_pd")(self.ctx)
        if not pd:
            raise _fail("ibv_alloc_pd", self.name, ctypes.get_errno())
        self._pds.append(ProtectionDomain(self, pd))
        return self._pds[-1]

    def create_comp_channel(self) -> "CompletionChannel":
        """A completion channel: its `fd` becomes readable when an armed completion queue gets an entry.
        Whether Apple's provider signals one is not known (the symbols are exported, per tmc/apple): a caller
        must also work without (poll with bounded backoff) if this raises."""
        self._check()
        ctypes.set_errno(0)
        ch = self.verbs.call("ibv_create_comp_channel")(self.ctx)
        if not ch:
            raise _fail("ibv_create_comp_channel", self.name, ctypes.get_errno())
        self._channels.append(CompletionChannel(self, ch))
        return self._channels[-1]

    def create_cq(self, entries: int, channel: "CompletionChannel | None" = None,
                  max_poll: int = 16) -> "CompletionQueue":
        """A completion queue of at least `entries` entries; `poll` reads up to `max_poll` at a time."""
        self._check()
        ctypes.set_errno(0)
        cq = self.verbs.call("ibv_create_cq")(self.ctx, entries, None, channel.channel if channel else None, 0)
        if not cq:
            raise _fail("ibv_create_cq", self.name, ctypes.get_errno(), f"{entries} entries")
        self._cqs.append(CompletionQueue(self, cq, max_poll, channel))
        return self._cqs[-1]

    def close(self) -> None:
        if not self.ctx:
            return
        first: RdmaError | None = None
        for group in (self._qps, self._mrs, self._cqs, self._channels, self._pds):
            for obj in reversed(group):
                try:
                    obj.close()
                except RdmaError as exc:
                    first = first or exc
            group.clear()
        ctx, self.ctx = self.ctx, 0
        self.context = None  # type: ignore[assignment]
        ctypes.set_errno(0)
        rc = self.verbs.call("ibv_close_device")(ctx)
        if rc and first is None:
            first = _fail("ibv_close_device", self.name, _status(rc))
        if first is not None:
            raise first

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProtectionDomain:
    def __init__(self, device: Device, pd: int) -> None:
        self.device = device
        self.pd = pd

    def reg_mr(self, address: int, length: int, access: int = DEFAULT_ACCESS, owner: object = None) -> "MemoryRegion":
        """Register [address, address + length). `owner` (the buffer object) is kept alive with the region."""
        self.device._check()
        ctypes.set_errno(0)
        mr = self.device.verbs.call("ibv_reg_mr")(self.pd, address, length, access)
        if not mr:
            raise _fail("ibv_reg_mr", self.device.name, ctypes.get_errno(), f"{length} bytes")
        region = MemoryRegion(self.device, mr, owner)
        self.device._mrs.append(region)
        return region

    def reg_buffer(self, buffer: Any, access: int = DEFAULT_ACCESS) -> "MemoryRegion":
        """Register a writable buffer object (bytearray, mmap, numpy array, ...)."""
        view = memoryview(buffer).cast("B")
        holder = (c_char * view.nbytes).from_buffer(view)
        return self.reg_mr(ctypes.addressof(holder), view.nbytes, access, owner=(buffer, view, holder))

    def create_qp(self, send_cq: "CompletionQueue", recv_cq: "CompletionQueue", max_send_wr: int,
                  max_recv_wr: int, max_send_sge: int = 1, max_recv_sge: int = 1,
                  qp_type: int = IBV_QPT_UC, sq_sig_all: bool = False) -> "QueuePair":
        """A queue pair (UC by default: Apple's provider refuses RC with EOPNOTSUPP)."""
        self.device._check()
        attr = ibv_qp_init_attr()
        attr.send_cq = ctypes.cast(send_cq.cq, POINTER(ibv_cq))
        attr.recv_cq = ctypes.cast(recv_cq.cq, POINTER(ibv_cq))
        attr.cap.max_send_wr, attr.cap.max_recv_wr = max_send_wr, max_recv_wr
        attr.cap.max_send_sge, attr.cap.max_recv_sge = max_send_sge, max_recv_sge
        attr.qp_type, attr.sq_sig_all = qp_type, int(sq_sig_all)
        ctypes.set_errno(0)
        qp = self.device.verbs.call("ibv_create_qp")(self.pd, ctypes.byref(attr))
        if not qp:
            kind = {IBV_QPT_RC: "RC", IBV_QPT_UC: "UC", IBV_QPT_UD: "UD"}.get(qp_type, str(qp_type))
            raise _fail("ibv_create_qp", self.device.name, ctypes.get_errno(), f"{kind} queue pair")
        pair = QueuePair(self, qp, send_cq, recv_cq, attr.cap)
        self.device._qps.append(pair)
        return pair

    def close(self) -> None:
        pd, self.pd = self.pd, 0
        if pd:
            ctypes.set_errno(0)
            rc = self.device.verbs.call("ibv_dealloc_pd")(pd)
            if rc:
                raise _fail("ibv_dealloc_pd", self.device.name, _status(rc))


class MemoryRegion:
    def __init__(self, device: Device, mr: int, owner: object) -> None:
        self.device = device
        self.mr = mr
        self.owner = owner
        s = ibv_mr.from_address(mr)
        self.addr, self.length, self.lkey, self.rkey = s.addr or 0, s.length, s.lkey, s.rkey

    def close(self) -> None:
        """ibv_dereg_mr (close the queue pairs that use the region first)."""
        mr, self.mr = self.mr, 0
        if mr:
            ctypes.set_errno(0)
            rc = self.device.verbs.call("ibv_dereg_mr")(mr)
            self.owner = None
            if rc:
                raise _fail("ibv_dereg_mr", self.device.name, _status(rc))


class CompletionChannel:
    def __init__(self, device: Device, channel: int) -> None:
        self.device = device
        self.channel = channel
        self.fd = ibv_comp_channel.from_address(channel).fd
        self._cq = c_void_p()
        self._cq_context = c_void_p()

    def get_event(self) -> int:
        """Block until an armed completion queue of this channel has an entry (poll `fd` first to avoid
        blocking); returns that CQ's address. Every event must be acknowledged (`CompletionQueue.ack`)."""
        ctypes.set_errno(0)
        rc = self.device.verbs.call("ibv_get_cq_event")(self.channel, ctypes.byref(self._cq),
                                                        ctypes.byref(self._cq_context))
        if rc:
            raise _fail("ibv_get_cq_event", self.device.name, _status(rc))
        return self._cq.value or 0

    def close(self) -> None:
        ch, self.channel = self.channel, 0
        if ch:
            ctypes.set_errno(0)
            rc = self.device.verbs.call("ibv_destroy_comp_channel")(ch)
            if rc:
                raise _fail("ibv_destroy_comp_channel", self.device.name, _status(rc))


class CompletionQueue:
    """A completion queue and a reusable array of `max_poll` ibv_wc entries. Hot path:

        n = cq.poll()                 # ibv_poll_cq through ctx->ops, into cq.wc
        for i in range(n):
            wr_id, status, opcode, byte_len, qp_num = cq.entry(i)
    """

    def __init__(self, device: Device, cq: int, max_poll: int, channel: CompletionChannel | None) -> None:
        self.device = device
        self.cq = cq
        self.channel = channel
        self.max_poll = max_poll
        self.wc = (ibv_wc * max_poll)()
        self._wc_addr = ctypes.addressof(self.wc)
        self._cq_arg = c_void_p(cq)
        self._wc_arg = c_void_p(self._wc_addr)
        self._events = 0
        # As ibv_poll_cq does: cq->context->ops.poll_cq (the context the provider put in the CQ).
        ops = ibv_cq.from_address(cq).context.contents.ops
        self._poll = POLL_CQ(ops.poll_cq)
        self._notify = REQ_NOTIFY_CQ(ops.req_notify_cq) if ops.req_notify_cq else None

    def poll(self) -> int:
        """Up to max_poll completions into `wc`; their count."""
        n = self._poll(self._cq_arg, self.max_poll, self._wc_arg)
        if n < 0:
            raise _fail("poll_cq", self.device.name, n)
        return n

    def entry(self, i: int) -> tuple[int, int, int, int, int]:
        """(wr_id, status, opcode, byte_len, qp_num) of completion i of the last poll."""
        wr_id, status, opcode, _vendor, byte_len, _imm, qp_num, _src = WC.unpack_from(self.wc, i * WC_BYTES)
        return wr_id, status, opcode, byte_len, qp_num

    def completions(self) -> list[tuple[int, int, int, int, int]]:
        """Poll once and unpack every entry (not for the hot path: it builds a list)."""
        return [self.entry(i) for i in range(self.poll())]

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the queue: its channel's fd becomes readable at the next completion. Poll once more after
        arming; a completion that came in between raises no event."""
        if self._notify is None:
            raise _fail("req_notify_cq", self.device.name, _errno.EOPNOTSUPP)
        rc = self._notify(self._cq_arg, int(solicited_only))
        if rc:
            raise _fail("req_notify_cq", self.device.name, rc)

    def ack(self, events: int = 1) -> None:
        """Acknowledge events taken from the channel (ibv_destroy_cq waits for every one)."""
        self.device.verbs.call("ibv_ack_cq_events")(self.cq, events)

    def close(self) -> None:
        cq, self.cq = self.cq, 0
        if cq:
            ctypes.set_errno(0)
            rc = self.device.verbs.call("ibv_destroy_cq")(cq)
            if rc:
                raise _fail("ibv_destroy_cq", self.device.name, _status(rc))


class QueuePair:
    """A queue pair with one send and one receive work request (and their scatter/gather lists) allocated
    once and rewritten per post. Set-up: `to_init`, `to_rtr` (with the peer's QP number, PSN and GID),
    `to_rts`; post receives only after RTS (Apple's provider refuses them before: llama.cpp)."""

    def __init__(self, pd: ProtectionDomain, qp: int, send_cq: CompletionQueue, recv_cq: CompletionQueue,
                 cap: ibv_qp_cap) -> None:
        self.pd = pd
        self.device = pd.device
        self.qp = qp
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.max_send_wr, self.max_recv_wr = cap.max_send_wr, cap.max_recv_wr
        self.max_send_sge, self.max_recv_sge = max(1, cap.max_send_sge), max(1, cap.max_recv_sge)
        s = ibv_qp.from_address(qp)
        self.qp_num = s.qp_num
        # As the inline ibv_post_send/ibv_post_recv do: qp->context->ops.post_send / post_recv.
        ops = s.context.contents.ops
        self._post_send = POST_SEND(ops.post_send)
        self._post_recv = POST_RECV(ops.post_recv)
        self._send_sges = (ibv_sge * self.max_send_sge)()
        self._recv_sges = (ibv_sge * self.max_recv_sge)()
        self._swr = ibv_send_wr(sg_list=ctypes.cast(self._send_sges, POINTER(ibv_sge)), num_sge=1,
                                opcode=IBV_WR_SEND, send_flags=IBV_SEND_SIGNALED)
        self._send_nsge, self._send_flags = 1, IBV_SEND_SIGNALED
        self._rwr = ibv_recv_wr(sg_list=ctypes.cast(self._recv_sges, POINTER(ibv_sge)), num_sge=1)
        self._recv_nsge = 1
        self._bad = c_void_p()
        self._qp_arg = c_void_p(qp)
        self._swr_arg = c_void_p(ctypes.addressof(self._swr))
        self._rwr_arg = c_void_p(ctypes.addressof(self._rwr))
        self._bad_arg = c_void_p(ctypes.addressof(self._bad))
        self._attr = ibv_qp_attr()

    # set-up --------------------------------------------------------------------------------------------

    def modify(self, attr: ibv_qp_attr, mask: int, what: str = "") -> None:
        ctypes.set_errno(0)
        rc = self.device.verbs.call("ibv_modify_qp")(self.qp, ctypes.byref(attr), mask)
        if rc:
            state = QP_STATE_NAMES[attr.qp_state] if 0 <= attr.qp_state < len(QP_STATE_NAMES) else attr.qp_state
            raise _fail("ibv_modify_qp", self.device.name, _status(rc),
                        f"queue pair {self.qp_num} to {state}" + (f", {what}" if what else ""))

    def to_init(self, port: int = 1, access: int = DEFAULT_ACCESS) -> None:
        a = self._fresh_attr()
        a.qp_state, a.pkey_index, a.port_num, a.qp_access_flags = IBV_QPS_INIT, 0, port, access
        self.modify(a, INIT_MASK, f"port {port}")

    def to_rtr(self, remote_qp_num: int, remote_gid: bytes, remote_psn: int, sgid_index: int, port: int = 1,
               mtu: int = IBV_MTU_1024, remote_lid: int = 0) -> None:
        """Ready to receive from the peer's queue pair, addressed through the GRH (Apple's provider routes by
        the IPv4-mapped GIDs; JACCL and llama.cpp set is_global, hop_limit 1 and the local GID's index)."""
        a = self._fresh_attr()
        a.qp_state, a.path_mtu, a.rq_psn, a.dest_qp_num = IBV_QPS_RTR, mtu, remote_psn, remote_qp_num
        ah = a.ah_attr
        ah.dlid, ah.sl, ah.src_path_bits, ah.port_num, ah.is_global = remote_lid, 0, 0, port, 1
        ah.grh.hop_limit, ah.grh.sgid_index = 1, sgid_index
        ctypes.memmove(ah.grh.dgid.raw, bytes(remote_gid), 16)
        self.modify(a, RTR_MASK, f"peer queue pair {remote_qp_num} at {gid_text(remote_gid)}, GID index {sgid_index}")

    def to_rts(self, psn: int) -> None:
        a = self._fresh_attr()
        a.qp_state, a.sq_psn = IBV_QPS_RTS, psn
        self.modify(a, RTS_MASK)

    def _fresh_attr(self) -> ibv_qp_attr:
        ctypes.memset(ctypes.byref(self._attr), 0, sizeof(ibv_qp_attr))
        return self._attr

    # data path -----------------------------------------------------------------------------------------

    def post_send(self, wr_id: int, addr: int, length: int, lkey: int, signaled: bool = True) -> None:
        """One SEND of [addr, addr + length) (inside a region registered with `lkey`)."""
        _pack_sge(self._send_sges, 0, addr, length, lkey)
        self._swr.wr_id = wr_id  # an attribute store: half the cost of a pack_into
        flags = IBV_SEND_SIGNALED if signaled else 0
        if flags != self._send_flags or self._send_nsge != 1:  # the tail rarely changes: write it then
            self._set_send_tail(1, flags)
        rc = self._post_send(self._qp_arg, self._swr_arg, self._bad_arg)
        if rc:
            raise _fail("ibv_post_send", self.device.name, rc, f"queue pair {self.qp_num}, {length} bytes")

    def post_send_sges(self, wr_id: int, sges: Sequence[tuple[int, int, int]], signaled: bool = True) -> None:
        """One SEND gathered from `sges`: (addr, length, lkey) each, at most max_send_sge."""
        if not 0 < len(sges) <= self.max_send_sge:
            raise ValueError(f"1 to {self.max_send_sge} scatter/gather entries, got {len(sges)}")
        for i, (addr, length, lkey) in enumerate(sges):
            _pack_sge(self._send_sges, i * 16, addr, length, lkey)
        self._swr.wr_id = wr_id
        self._set_send_tail(len(sges), IBV_SEND_SIGNALED if signaled else 0)
        rc = self._post_send(self._qp_arg, self._swr_arg, self._bad_arg)
        if rc:
            raise _fail("ibv_post_send", self.device.name, rc, f"queue pair {self.qp_num}")

    def _set_send_tail(self, num_sge: int, flags: int) -> None:
        SEND_WR_TAIL.pack_into(self._swr, 24, num_sge, IBV_WR_SEND, flags)
        self._send_nsge, self._send_flags = num_sge, flags

    def post_recv(self, wr_id: int, addr: int, length: int, lkey: int) -> None:
        """One receive into [addr, addr + length)."""
        _pack_sge(self._recv_sges, 0, addr, length, lkey)
        self._rwr.wr_id = wr_id
        if self._recv_nsge != 1:
            self._rwr.num_sge = self._recv_nsge = 1
        rc = self._post_recv(self._qp_arg, self._rwr_arg, self._bad_arg)
        if rc:
            raise _fail("ibv_post_recv", self.device.name, rc, f"queue pair {self.qp_num}, {length} bytes")

    def post_recv_sges(self, wr_id: int, sges: Sequence[tuple[int, int, int]]) -> None:
        if not 0 < len(sges) <= self.max_recv_sge:
            raise ValueError(f"1 to {self.max_recv_sge} scatter/gather entries, got {len(sges)}")
        for i, (addr, length, lkey) in enumerate(sges):
            _pack_sge(self._recv_sges, i * 16, addr, length, lkey)
        self._rwr.wr_id = wr_id
        self._rwr.num_sge = self._recv_nsge = len(sges)
        rc = self._post_recv(self._qp_arg, self._rwr_arg, self._bad_arg)
        if rc:
            raise _fail("ibv_post_recv", self.device.name, rc, f"queue pair {self.qp_num}")

    def close(self) -> None:
        """ibv_destroy_qp, straight from whatever state (no ERR first: see Device)."""
        qp, self.qp = self.qp, 0
        if qp:
            ctypes.set_errno(0)
            rc = self.device.verbs.call("ibv_destroy_qp")(qp)
            if rc:
                raise _fail("ibv_destroy_qp", self.device.name, _status(rc), f"queue pair {self.qp_num}")
