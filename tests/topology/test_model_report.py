import json

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.topology.draw import to_dot, write_png
from torch_thunderbolt.topology.graph import build_graph
from torch_thunderbolt.topology.model import ClusterGraph, Host, load_host_dump
from torch_thunderbolt.topology.report import analyse, analysis_json, cluster_report, host_summary, hostfile

from .topo_fixtures import mac_host, scenario_hosts


def test_host_and_graph_json_round_trip():
    host = mac_host("pair", "mac-a")
    assert Host.from_json(json.loads(json.dumps(host.to_json()))) == host
    graph = build_graph(scenario_hosts("mesh4"))
    assert ClusterGraph.from_json(json.loads(json.dumps(graph.to_json()))) == graph


@pytest.mark.parametrize("text, message", [
    ("{", "invalid JSON"),
    ("[]", "expected a JSON object"),
    ('{"name": ""}', "non-empty 'name'"),
    ('{"name": "x", "format": "other/9"}', "unsupported dump format"),
    ('{"name": "x", "ports": {}}', "expected a list for 'ports'"),
    ('{"name": "x", "ports": [{"ifname": "en2"}]}', "bad port"),
    ('{"name": "x", "services": []}', "'services' must be an object"),
])
def test_bad_dumps_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_host_dump(text, "a.json")
    assert str(info.value).startswith("a.json: ")


def test_unknown_fields_are_ignored_for_forward_compatibility():
    host = load_host_dump('{"name": "x", "future": 1, "ports": [{"name": "Thunderbolt 1", "new": 2}]}', "d")
    assert host.ports[0].name == "Thunderbolt 1"


def test_graph_json_requires_hosts_and_cables():
    with pytest.raises(ConfigError, match="'hosts' and 'cables'"):
        ClusterGraph.from_json({"hosts": []})


def test_host_summary_lists_ports_and_no_thunderbolt_message():
    text = host_summary(mac_host("pair", "mac-a"))
    assert "Thunderbolt 3  en4" in text and "device: Studio Display" in text and "Bridge bridge0: active" in text
    empty = host_summary(Host("vm", platform="linux", checked=["/sys/class/net/thunderbolt*"]))
    assert "No Thunderbolt interfaces found on vm" in empty and "/sys/class/net/thunderbolt*" in empty


def test_cluster_report_and_json():
    a = analyse(scenario_hosts("bridge_loop"))
    text = cluster_report(a)
    assert "shape: ring; ring order: mac-a -> mac-b -> mac-c -> mac-a" in text
    assert "Thunderbolt Bridge loops: 1 FOUND" in text and "sudo /usr/sbin/networksetup -setmanual" in text
    data = json.loads(json.dumps(analysis_json(a)))
    assert data["shape"] == "ring" and data["order"] == {"kind": "ring", "hosts": ["mac-a", "mac-b", "mac-c"]}
    assert len(data["bridge_loops"]) == 1 and len(data["plan"]["assignments"]) == 3
    assert all("shell" in c for c in data["commands"])


def test_hostfile_follows_the_ring_and_carries_ifnames():
    hf = hostfile(analyse(scenario_hosts("ring3")))
    assert [h["name"] for h in hf] == ["mac-a", "mac-b", "mac-c"]
    a = hf[0]
    assert a["ssh"] == "mac-a.local" and a["addresses"] == ["10.77.0.1", "10.77.0.5"] and a["ifname"] == "en2,en3"
    assert a["cables"][0] == {"ifname": "en2", "address": "10.77.0.1", "peer": "mac-b", "peer_ifname": "en2",
                              "peer_address": "10.77.0.2", "network": "10.77.0.0/30", "speed_gbps": 120.0}


def test_hostfile_double_cable_lists_both_interfaces():
    [a, b] = hostfile(analyse(scenario_hosts("double")))
    assert a["ifname"] == "en2,en3" and len(a["cables"]) == 2


def test_dot_output():
    a = analyse(scenario_hosts("bridge_loop"))
    dot = to_dot(a.graph, a.plan, a.loops)
    assert dot.startswith("graph thunderbolt {") and dot.rstrip().endswith("}")
    assert dot.count(" -- ") == 3 and dot.count("color=red") == 3
    assert '"mac-a" [label="mac-a\\nMac Studio"];' in dot
    assert 'taillabel="en2", headlabel="en2", label="40 Gb/s 10.77.0.0/30"' in dot
    plain = to_dot(build_graph(scenario_hosts("ring3")))
    assert "color=red" not in plain and 'label="120 Gb/s"' in plain


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    a = analyse(scenario_hosts("double"))
    out = tmp_path / "g.png"
    write_png(out, a.graph, a.plan, a.loops, order=a.order[1])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("port, message", [
    ('{"name": "T1", "speed_gbps": "fast"}', "'speed_gbps' should be float"),
    ('{"name": "T1", "addresses": "10.0.0.1/30"}', "'addresses' should be list"),
    ('{"name": 7}', "'name' should be str"),
])
def test_dump_field_types_are_checked(port, message):
    with pytest.raises(ConfigError, match=message):
        load_host_dump('{"name": "x", "ports": [%s]}' % port, "d.json")
