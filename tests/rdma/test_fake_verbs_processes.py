"""The fake verbs fabric across processes: two ranks, each with its own provider, select the fabric with
THUNDERBOLT_VERBS and run the binding end to end (open, PD, MR, CQ with a completion channel, UC QP,
INIT -> RTR -> RTS, receives, sends, polls); faults set in one process act on the other; a crashed
process's queue pairs stop counting. The fabric directory is removed even when a test fails."""
from __future__ import annotations

import zlib

import pytest

from torch_thunderbolt.testing.fake_verbs import fabric_env, fake_fabric
from torch_thunderbolt.testing.ranks import run_ranks

from .programs import verbs_pair

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(180)]


def test_two_processes_exchange_every_size_and_wake_on_the_channel(tmp_path) -> None:
    with fake_fabric(tmp_path / "fabric") as fabric:
        r0, r1 = run_ranks(verbs_pair, 2, tmp_path / "run", args=["pingpong"], env=fabric_env(fabric), timeout=120)
    a, b = r0.json(), r1.json()
    assert a["sums"] == b["sums"] and len(a["sums"]) == 3 * len(verbs_pair.SIZES)
    assert len(set(a["sums"])) > 1 and zlib.crc32(b"") not in a["sums"]
    assert b["woke"] >= 1  # slept on the completion channel's fd and was woken by the other process
    assert a["failures"] == b["failures"] == []
    assert not (tmp_path / "fabric").exists()


def test_faults_set_by_one_process_act_on_the_other(tmp_path) -> None:
    with fake_fabric(tmp_path / "fabric") as fabric:
        r0, r1 = run_ranks(verbs_pair, 2, tmp_path / "run", args=["faults"], env=fabric_env(fabric), timeout=150)
    a, b = r0.json(), r1.json()
    assert a["dropped"] == 1 and b["drop"] == [[1, 1, 0xB]]  # the first message lost, the second in the receive
    assert a["held"] and b["nothing_while_stalled"]
    assert a["after_release"] == [[20, 0]] and b["after_release"] == [[3, 0]]
    assert b["port"] == "DOWN" and a["sent_down"] == [[30, 0]] and b["nothing_while_down"]
    assert a["devices"] == ["rdma_fake0"]
    call, err, text = b["gone"]
    assert (call, err) == ("poll_cq", 19) and "the RDMA device is gone" in text
    assert a["wedged"] == ["ibv_modify_qp", 110] and a["after_reboot"] == "RTR"
    assert a["failures"] == b["failures"] == []


def test_a_crashed_process_frees_its_queue_pairs(tmp_path) -> None:
    with fake_fabric(tmp_path / "fabric", max_qp=3) as fabric:
        r0, _ = run_ranks(verbs_pair, 2, tmp_path / "run", args=["qp_limit"], timeout=120,
                          env={**fabric_env(fabric), "TEST_DEVICE": "rdma_fake0"})
    assert r0.json()["while_alive"] == 16  # EBUSY
    assert r0.json()["after_death"] > 0
