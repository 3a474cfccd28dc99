"""The first connection of a job is torch's rendezvous store: a blocked one gives our error and fix at once
(Local Network privacy, no route) or after THUNDERBOLT_CONNECT_TIMEOUT (refused, unanswered), not torch's
retries until the group timeout. Unit tests feed the probe OS errors; a rank process meets a refused port
through init_process_group with env://, thunderbolt:// and tcp://."""
from __future__ import annotations

import errno
import socket

import pytest

from torch_thunderbolt.config import Config
from torch_thunderbolt.errors import ConfigError, PeerLostError
from torch_thunderbolt.platform import LOCAL_NETWORK_SETTING, Platform
from torch_thunderbolt.rendezvous import store_probe
from torch_thunderbolt.rendezvous.store_probe import probe_store, probe_url
from torch_thunderbolt.testing.ranks import free_port, run_ranks

from .programs import store_probe as program

MAC = Platform.for_system("darwin")
LINUX = Platform.for_system("linux")


class FakeNet:
    """connect() answers from a script of errnos (0 = connected); a fake clock advances per attempt."""

    def __init__(self, script: list[int], step: float = 0.5) -> None:
        self.script, self.step, self.now, self.targets = list(script), step, 0.0, []

    def connect(self, target: tuple[str, int], timeout: float) -> socket.socket:
        self.targets.append(target)
        self.now += self.step
        code = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if code == 0:
            return socket.socket()
        if code == errno.ECONNREFUSED:
            raise ConnectionRefusedError(code, "Connection refused")
        if code == errno.ETIMEDOUT:
            raise socket.timeout("timed out")
        raise OSError(code, "error")

    def probe(self, host: str = "10.77.0.1", plat: Platform = MAC, timeout: float | None = None,
              cfg: Config = Config(connect_timeout=10.0)) -> None:
        probe_store(host, 29500, 1, cfg, timeout, plat=plat, connect=self.connect, clock=lambda: self.now,
                    sleep=lambda s: None)


def test_local_network_denial_is_named_after_three_tries() -> None:
    net = FakeNet([errno.EHOSTUNREACH])
    with pytest.raises(ConfigError) as info:
        net.probe()
    message = str(info.value)
    assert len(net.targets) == 3 and "rank 1:" in message and "rendezvous store at 10.77.0.1:29500" in message
    assert LOCAL_NETWORK_SETTING in message and "EHOSTUNREACH" in message
    with pytest.raises(ConfigError, match="EPERM, 3 times"):
        FakeNet([errno.EPERM]).probe()


def test_unreachable_host_on_linux_is_retried_until_the_connect_timeout() -> None:
    net = FakeNet([errno.EHOSTUNREACH])
    with pytest.raises(PeerLostError, match="host unreachable") as info:
        net.probe(plat=LINUX)
    assert len(net.targets) == 20  # 10 s of 0.5 s attempts (THUNDERBOLT_CONNECT_TIMEOUT=10)
    assert info.value.peer == 0 and info.value.address == "10.77.0.1:29500"


def test_no_route_fails_at_once() -> None:
    net = FakeNet([errno.ENETUNREACH])
    with pytest.raises(ConfigError, match=r"no route from this Mac to the rendezvous store at 10\.77\.0\.1:29500"):
        net.probe()
    assert len(net.targets) == 1


def test_refused_until_rank_0_serves_it_then_fine() -> None:
    net = FakeNet([errno.ECONNREFUSED] * 4 + [0])
    net.probe()
    assert len(net.targets) == 5


def test_refused_and_unanswered_end_at_the_shorter_timeout_with_what_to_check() -> None:
    net = FakeNet([errno.ECONNREFUSED, errno.ETIMEDOUT])
    with pytest.raises(PeerLostError) as info:
        net.probe(timeout=3.0)  # the group's timeout is shorter than THUNDERBOLT_CONNECT_TIMEOUT here
    message = str(info.value)
    assert len(net.targets) == 6
    assert "1 attempt(s) refused" in message and "5 attempt(s) unanswered" in message
    assert "firewall" in message and "ping 10.77.0.1" in message and LOCAL_NETWORK_SETTING in message
    assert "MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 torch-thunderbolt doctor" in message
    assert "THUNDERBOLT_CONNECT_TIMEOUT" in message


def test_loopback_is_never_a_local_network_denial() -> None:
    net = FakeNet([errno.EPERM])
    with pytest.raises(PeerLostError):
        net.probe(host="127.0.0.1")
    assert len(net.targets) > 3


def test_an_unknown_name_fails_at_once() -> None:
    with pytest.raises(ConfigError, match="cannot resolve MASTER_ADDR=no-such-mac.invalid"):
        FakeNet([0]).probe(host="no-such-mac.invalid")


def test_only_store_clients_probe(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(store_probe, "probe_store", lambda host, port, rank, cfg, timeout: calls.append(
        (host, port, rank, timeout)))
    env = {"MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500"}
    probe_url("env://?rank=0&world_size=2", 60.0, env)  # rank 0 serves the store
    assert calls == []
    probe_url("env://?rank=0&world_size=2", 60.0, env | {"TORCHELASTIC_USE_AGENT_STORE": "True"})  # torchrun's agent
    probe_url("env://?rank=1&world_size=2", None, env)
    probe_url("tcp://10.77.0.9:1234?rank=2&world_size=3", None, env)
    assert calls == [("10.77.0.1", 29500, 0, 60.0), ("10.77.0.1", 29500, 1, None), ("10.77.0.9", 1234, 2, None)]
    probe_url("env://", None, {})  # nothing to go on: torch's handler names what is missing
    assert len(calls) == 3


def test_every_rank_checks_the_settings_before_the_store(monkeypatch) -> None:
    """Rank 0 too (it serves the store, so it probes nothing): a setting the backend would refuse stops it
    before torch's handler makes the store and waits there for ranks that already stopped."""
    monkeypatch.setattr(store_probe, "probe_store", lambda *a: pytest.fail("probed the store"))
    bad = {"MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500", "THUNDERBOLT_SECRET": "not-a-secret"}
    for url, env in (("env://?rank=0&world_size=2", bad), ("env://", bad | {"RANK": "0"}),
                     ("env://?rank=0&world_size=2", bad | {"TORCHELASTIC_USE_AGENT_STORE": "True"})):
        with pytest.raises(ConfigError, match=r"^rank 0: THUNDERBOLT_SECRET: expected a random secret"):
            probe_url(url, 60.0, env)
    with pytest.raises(ConfigError, match=r"^THUNDERBOLT_TRANSPORT"):  # no rank to name: the setting alone
        probe_url("env://", None, {"THUNDERBOLT_TRANSPORT": "carrier-pigeon"})


def test_rank_0_warns_when_torchrun_restarts_over_one_shared_store(monkeypatch, caplog) -> None:
    monkeypatch.setattr(store_probe, "probe_store", lambda *a: None)
    agent = {"MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    quiet = [({**agent, "TORCHELASTIC_MAX_RESTARTS": "0"}, 0), ({**agent, "TORCHELASTIC_MAX_RESTARTS": "3"}, 1),
             ({"MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "False",
               "TORCHELASTIC_MAX_RESTARTS": "3"}, 0)]  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a store per round
    for env, rank in quiet:
        probe_url(f"env://?rank={rank}&world_size=2", 60.0, env)
    assert not caplog.records
    probe_url("env://?rank=0&world_size=2", 60.0, {**agent, "TORCHELASTIC_MAX_RESTARTS": "3"})
    [record] = caplog.records
    assert record.getMessage().startswith("rank 0: torchrun may restart this job (--max-restarts 3)")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in record.getMessage()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_refused_setting_stops_every_rank_at_once(tmp_path) -> None:
    """The same bad secret on both ranks: rank 0 stops as rank 1 does, naming the setting (it waited for
    rank 1 to join the store for the group's whole timeout, then said only that 1 of 2 ranks joined)."""
    results = run_ranks(program, 2, tmp_path, args=["refused_settings"], timeout=100,
                        env={"THUNDERBOLT_SECRET": "not-a-secret"})
    for res in results:
        out = res.json()
        assert out["error"] == "ConfigError", (res.rank, out)
        assert out["message"].startswith(f"rank {res.rank}: THUNDERBOLT_SECRET: expected a random secret"), out
        assert out["seconds"] < 30, out  # torch's wait would be the group's timeout: 600 s here


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_refused_store_is_our_error_for_every_init_method_of_ours(tmp_path) -> None:
    port = free_port()  # nobody listens there: rank 0 is never started
    [res] = run_ranks(program, 1, tmp_path, args=["refused"], timeout=100,
                      env={"MASTER_PORT": str(port), "THUNDERBOLT_CONNECT_TIMEOUT": "1", "WORLD_SIZE": "2"},
                      per_rank={0: {"RANK": "1", "LOCAL_RANK": "1"}})
    out = res.json()
    for init in ("env", "thunderbolt", "tcp"):
        assert out[init]["error"] == "PeerLostError", (init, out[init])
        assert f"rank 1: could not connect to the rendezvous store at 127.0.0.1:{port}" in out[init]["message"]
        assert "refused" in out[init]["message"]
    assert out["gloo"]["error"] != "PeerLostError" and "rendezvous store" not in out["gloo"]["message"]
