"""`doctor` says which addresses a job would use and why (through the job's own choose_addresses), what the
first connection (MASTER_ADDR:MASTER_PORT) runs into, and what this version was tested on."""
from __future__ import annotations

import socket

import pytest

from torch_thunderbolt import doctor
from torch_thunderbolt.doctor import FAIL, OK, WARN, Facts, probe_store_once, run_checks
from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.testing.ranks import free_port
from torch_thunderbolt.transport import netif

TABLE = {"lo0": ["127.0.0.1"], "en0": ["192.168.1.4"], "en2": ["10.77.0.1"], "en3": ["10.77.0.5"]}


def facts(env: dict[str, str], **kw) -> Facts:
    chosen, error = doctor.choose(env, env.get("MASTER_ADDR", ""), TABLE)
    base = dict(system="Linux", python="3.11", torch="2.13.0", backend_registered=True, env=env,
                interfaces=TABLE, thunderbolt_ifnames=["en2", "en3"], mtus={}, store_host=env.get("MASTER_ADDR", ""),
                chosen_addresses=chosen, choice_error=error)
    base.update(kw)
    return Facts(**base)


def finding(f: Facts, check: str = "addresses a job uses"):
    return {x.check: x for x in run_checks(f)}[check]


def test_named_interfaces_are_the_addresses_and_the_reason() -> None:
    found = finding(facts({"THUNDERBOLT_IFNAME": "en2,en3", "THUNDERBOLT_PORT": "29600", "LOCAL_RANK": "1"}))
    assert found.status == OK
    assert found.detail.startswith("10.77.0.1 (en2), 10.77.0.5 (en3): named by THUNDERBOLT_IFNAME=en2,en3")
    assert "port 29601" in found.detail


def test_an_unknown_interface_is_the_jobs_own_error() -> None:
    found = finding(facts({"THUNDERBOLT_IFNAME": "en7"}))
    with pytest.raises(ConfigError) as job:
        netif.choose_addresses(("en7",), None, TABLE)
    assert found.status == FAIL and found.detail == str(job.value)


def test_the_route_to_master_addr_decides_without_ifname() -> None:
    found = finding(facts({"MASTER_ADDR": "127.0.0.1"}))
    assert found.status == OK and "MASTER_ADDR=127.0.0.1" in found.detail
    wifi = finding(facts({}, store_host="10.1.2.3", chosen_addresses=["192.168.1.4"]))
    assert wifi.status == WARN and "en0 is not a Thunderbolt interface" in wifi.detail
    assert "THUNDERBOLT_IFNAME=en2,en3" in wifi.fix
    alone = finding(facts({}))
    assert alone.status == OK and "127.0.0.1 (lo0)" in alone.detail and "loopback" in alone.detail


def test_doctor_asks_the_jobs_own_function(monkeypatch) -> None:
    """Not a copy of the choice: whatever choose_addresses answers is what doctor reports."""
    monkeypatch.setattr(netif, "choose_addresses", lambda ifnames, host, table=None: ["10.77.0.5"])
    assert doctor.choose({"MASTER_ADDR": "10.77.0.2"}, "10.77.0.2", TABLE) == (["10.77.0.5"], "")


def test_the_store_probe_tells_refused_from_accepted() -> None:
    port = free_port()
    assert probe_store_once({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) == "refused"
    with socket.create_server(("127.0.0.1", 0)) as srv:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(srv.getsockname()[1])}
        assert probe_store_once(env) == "accepted"
    assert probe_store_once({"MASTER_ADDR": "127.0.0.1"}) == ""
    env = {"MASTER_ADDR": "10.77.0.2", "MASTER_PORT": "29500"}
    assert finding(facts(env, store_probe="refused"), "rendezvous store").status == OK
    silent = finding(facts(env, store_probe="ETIMEDOUT"), "rendezvous store")
    assert silent.status == WARN and "doctor --firewall-command" in silent.fix
    denied = finding(facts(env, store_probe="EHOSTUNREACH"), "rendezvous store")
    assert denied.status == FAIL and "Local Network" in denied.fix


def test_tested_versions_are_said_plainly() -> None:
    here = finding(facts({}), "tested versions")
    assert here.status == OK and "torch 2.13.0" in here.detail and "never run on a Mac" in here.detail
    mac = finding(facts({}, system="Darwin"), "tested versions")
    assert mac.status == WARN and "this is a Mac" in mac.detail and "topo --record" in mac.fix
    assert finding(facts({}, torch="2.6.0"), "tested versions").status == WARN
