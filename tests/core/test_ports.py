"""THUNDERBOLT_PORT with several TCP ranks on one host: a base port (each rank listens on base + LOCAL_RANK)
or a range (each rank takes a free port in it), so a firewall can open exactly the ranks' ports."""
from __future__ import annotations

import contextlib
import socket

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.rendezvous import tcp as bootstrap
from torch_thunderbolt.testing.ranks import run_ranks

from .programs import port_ranks


def free_ports(n: int) -> int:
    """A base port with the n ports from it free right now (other jobs may take one later: rare)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    pytest.skip(f"no {n} consecutive free ports found")


@pytest.mark.parametrize("value, local_rank, first, ports", [
    ("29600", None, 29600, [29600]),
    ("29600", "2", 29602, [29602]),
    (" 29600 - 29603 ", "1", 29601, [29601, 29602, 29603, 29600]),
    ("29600-29603", "6", 29602, [29602, 29603, 29600, 29601]),
    ("29600-29603", None, 29600, [29600, 29601, 29602, 29603]),
    ("0", "3", 0, [0]),
])
def test_port_values(value, local_rank, first, ports) -> None:
    env = {"THUNDERBOLT_PORT": value} | ({"LOCAL_RANK": local_rank} if local_rank else {})
    cfg = Config.from_env(env)
    assert cfg.port == first and cfg.listen_ports() == ports


@pytest.mark.parametrize("value, local_rank, match", [
    ("x", None, "expected a base port"), ("29600-29500", None, "expected a base port"),
    ("0-5", None, "expected a base port"), ("70000", None, "expected a base port"),
    ("29600-", None, "expected a base port"), ("65535", "1", "LOCAL_RANK=1: this rank's port would be 65536"),
    ("29600", "-1", "LOCAL_RANK: expected an integer"),
])
def test_bad_port_values_name_the_variable(value, local_rank, match) -> None:
    env = {"THUNDERBOLT_PORT": value} | ({"LOCAL_RANK": local_rank} if local_rank else {})
    with pytest.raises(ConfigError, match=match):
        Config.from_env(env)


def test_local_rank_is_read_only_with_a_port() -> None:
    assert Config.from_env({"LOCAL_RANK": "junk"}).port == 0


def test_a_range_takes_the_next_free_port_and_names_itself_when_full() -> None:
    base = free_ports(2)
    cfg = Config.from_env({"THUNDERBOLT_PORT": f"{base}-{base + 1}"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base))
        taken.listen(1)
        with bootstrap._listen("127.0.0.1", cfg, rank=0) as lst:
            assert lst.getsockname()[1] == base + 1
            with pytest.raises(ConfigError, match=rf"rank 1: THUNDERBOLT_PORT={base}-{base + 1}: every port"):
                bootstrap._listen("127.0.0.1", cfg, rank=1)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_tcp_ranks_on_one_host_with_a_base_port(tmp_path) -> None:
    """Each rank listens on base + LOCAL_RANK: rank 0 accepted ranks 1 and 2 on base, rank 1 accepted rank 2
    on base + 1 (rank 2 listened on base + 2, which nobody needed). One port for all failed on the second."""
    base = free_ports(3)
    results = run_ranks(port_ranks, 3, tmp_path, args=["listen"], timeout=90,
                        env={"THUNDERBOLT_TRANSPORT": "tcp", "THUNDERBOLT_PORT": str(base)})
    assert all(r.json()["ok"] for r in results)
    assert base in results[0].json()["ports"] and base + 1 in results[1].json()["ports"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_tcp_ranks_on_one_host_share_a_range_without_local_rank(tmp_path) -> None:
    """Both ranks start at the range's first port (LOCAL_RANK 0 on both, as in a hand-made launch): one takes
    the next free port."""
    base = free_ports(2)
    results = run_ranks(port_ranks, 2, tmp_path, args=["listen"], timeout=90,
                        env={"THUNDERBOLT_TRANSPORT": "tcp", "THUNDERBOLT_PORT": f"{base}-{base + 1}",
                             "LOCAL_RANK": "0"})
    assert all(r.json()["ok"] for r in results)
    assert base in results[0].json()["ports"] or base + 1 in results[0].json()["ports"]
