import json
import os

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.topology.discover import CommandResult, discover_local
from torch_thunderbolt.topology.graph import build_graph, classify
from torch_thunderbolt.topology.linux import build_linux_host, parse_ip_addr, read_sysfs

from .topo_fixtures import FIXTURES, scenario_hosts


def test_linux_pair_parses_and_links():
    a, b = scenario_hosts("linux_pair")
    port = a.ports[0]
    assert (port.name, port.ifname, port.receptacle) == ("thunderbolt0", "thunderbolt0", "1")
    assert port.speed_gbps == 40.0  # 20 Gb/s per lane x 2 lanes
    assert port.peer_name == "Linux nuc-b" and port.peer_uuid == b.ports[0].uuid
    assert a.other_addresses == ["192.168.1.31/24"] and a.model == "NUC13ANHi7"
    assert b.ports[0].addresses == ["10.77.0.2/30"]
    graph = build_graph([a, b])
    assert classify(graph) == "pair"
    assert [(c.a_host, c.a_port, c.b_host, c.b_port) for c in graph.cables] == [
        ("nuc-a", "thunderbolt0", "nuc-b", "thunderbolt0")]


def _fake_sysfs(root, with_net=True):
    dev = root / "sys/bus/thunderbolt/devices"
    for name, attrs in json.loads((FIXTURES / "linux_pair/nuc-a/sysfs.json").read_text())["devices"].items():
        (dev / name).mkdir(parents=True)
        for key, value in attrs.items():
            (dev / name / key).write_text(value + "\n")
    (dev / "domain0").mkdir()  # a domain has none of the attributes we read: ignored
    service = dev / "0-1" / "0-1.0"
    service.mkdir()
    if with_net:
        net = root / "sys/class/net/thunderbolt0"
        net.mkdir(parents=True)
        os.symlink(service, net / "device")


def test_read_sysfs_from_a_fake_tree(tmp_path):
    _fake_sysfs(tmp_path)
    snap = read_sysfs(tmp_path)
    assert snap["net"] == {"thunderbolt0": "0-1.0"}
    assert set(snap["devices"]) == {"0-0", "0-1"} and snap["devices"]["0-1"]["rx_lanes"] == "2"
    assert snap == json.loads((FIXTURES / "linux_pair/nuc-a/sysfs.json").read_text())


def test_discover_local_linux_uses_sysfs_and_ip(tmp_path):
    _fake_sysfs(tmp_path)
    ip = (FIXTURES / "linux_pair/nuc-a/ip_addr.json").read_text()
    calls = []

    def run(argv):
        calls.append(list(argv))
        return CommandResult(0, ip)

    host = discover_local(run, system="Linux", hostname="nuc-a", sysfs_root=tmp_path)
    assert calls == [["ip", "-j", "addr"]]
    assert [p.ifname for p in host.ports] == ["thunderbolt0"] and host.ports[0].link_up


def test_linux_without_thunderbolt_has_no_ports(tmp_path):
    host = discover_local(lambda argv: CommandResult(1, "", "ip: not found"), system="Linux",
                          hostname="vm", sysfs_root=tmp_path)
    assert host.ports == [] and any("/sys/class/net/thunderbolt*" in c for c in host.checked)


def test_bridged_linux_port():
    sysfs = json.loads((FIXTURES / "linux_pair/nuc-a/sysfs.json").read_text())
    ip = json.dumps([{"ifname": "thunderbolt0", "mtu": 1500, "operstate": "UP", "master": "br0", "addr_info": []},
                     {"ifname": "br0", "mtu": 1500, "operstate": "UP", "addr_info": [
                         {"family": "inet", "local": "10.9.0.1", "prefixlen": 24}]}])
    host = build_linux_host("nuc-a", sysfs, ip)
    assert host.bridge.ifname == "br0" and host.bridge.members == ["thunderbolt0"] and host.bridge.active
    assert host.other_addresses == []


@pytest.mark.parametrize("text", ["{", '{"ifname": "x"}', '[{"mtu": 1}]'])
def test_malformed_ip_json(text):
    with pytest.raises(ConfigError, match="ip -j addr"):
        parse_ip_addr(text)


def test_bad_lane_count():
    sysfs = {"devices": {"0-1": {"unique_id": "u", "rx_speed": "20.0 Gb/s", "rx_lanes": "two"}},
             "net": {"thunderbolt0": "0-1.0"}}
    with pytest.raises(ConfigError, match="rx_lanes"):
        build_linux_host("h", sysfs, "[]")
