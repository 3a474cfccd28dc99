import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.topology import link_speed_gbps
from torch_thunderbolt.topology.macos import (build_macos_host, parse_hardware_ports, parse_ifconfig,
                                               parse_network_services, parse_system_profiler)

from .topo_fixtures import FIXTURES, mac_host, mac_outputs, scenario_hosts


@pytest.mark.parametrize("text, gbps", [
    ("Up to 40 Gb/s", 40.0), ("Up to 80 Gb/s", 80.0), ("Up to 120 Gb/s", 120.0), ("20.0 Gb/s", 20.0),
    ("10000 Mb/s", 10.0), ("", 0.0), ("  Up to 10 Gbps ", 10.0),
])
def test_link_speed_gbps(text, gbps):
    assert link_speed_gbps(text) == gbps


@pytest.mark.parametrize("text", ["fast", "Up to forty Gb/s", "40"])
def test_link_speed_rejects_text_without_a_speed(text):
    with pytest.raises(ConfigError, match="link speed"):
        link_speed_gbps(text)


def test_pair_host_ports_devices_and_empty_ports():
    host = mac_host("pair", "mac-a")
    assert host.model == "Mac Studio" and host.platform == "macos"
    assert [p.name for p in host.ports] == [f"Thunderbolt {i}" for i in range(1, 7)]
    assert [p.ifname for p in host.ports] == [f"en{i}" for i in range(2, 8)]
    mac, empty, display, drive = host.ports[:4]
    assert mac.status == "connected" and mac.has_computer and mac.peer_name == "Mac Studio"
    assert mac.peer_uuid == mac_host("pair", "mac-b").ports[0].uuid
    assert mac.speed_gbps == 40.0 and mac.speed_text == "Up to 40 Gb/s" and mac.link_up
    assert empty.status == "empty" and not empty.has_computer and not empty.devices and not empty.link_up
    assert display.devices == ["Studio Display"] and not display.has_computer
    assert drive.devices == ["Envoy Ultra"] and not drive.has_computer


def test_bridge_state_and_other_addresses():
    host = mac_host("pair", "mac-a")
    assert host.bridge.ifname == "bridge0" and host.bridge.active and host.bridge.service_enabled is True
    assert host.bridge.members == [f"en{i}" for i in range(2, 8)]
    assert host.other_addresses == ["192.168.1.20/24"]  # en0 only: not lo0, not the bridge's 169.254
    off = mac_host("ring3", "mac-a")
    assert off.bridge.members == [] and not off.bridge.active and off.bridge.service_enabled is False
    assert off.services["Thunderbolt 1"] is True and off.services["Thunderbolt Bridge"] is False


def test_tb5_speeds():
    assert {p.speed_gbps for p in mac_host("chain3", "mac-a").ports} == {80.0}
    assert {p.speed_gbps for p in mac_host("ring3", "mac-a").ports} == {120.0}


def test_ifconfig_addresses_netmask_and_members():
    ifaces = parse_ifconfig(mac_outputs("ring3", "mac-b")["ifconfig"])
    assert ifaces["en2"].addresses == ["10.77.0.2/30"] and ifaces["en2"].mtu == 1500
    assert ifaces["en0"].addresses == ["192.168.1.21/24"] and ifaces["en0"].active
    assert ifaces["lo0"].addresses == ["127.0.0.1/8"]
    assert parse_ifconfig("en9: flags=8863<UP,RUNNING> mtu 9000\n\tinet 10.0.0.1 netmask 255.255.255.252\n"
                          )["en9"].addresses == ["10.0.0.1/30"]


def test_hardware_ports_and_services():
    hw = parse_hardware_ports(mac_outputs("pair", "mac-a")["hardware_ports"])
    assert hw["Thunderbolt Bridge"] == "bridge0" and hw["Thunderbolt 1"] == "en2" and hw["Wi-Fi"] == "en1"
    assert "VLAN Configurations" not in hw
    assert parse_network_services("An asterisk (*) denotes that a network service is disabled.\n"
                                  "*Thunderbolt Bridge\nThunderbolt 1\n") == {"Thunderbolt Bridge": False,
                                                                             "Thunderbolt 1": True}


def test_speed_falls_back_to_the_attached_device():
    text = ('{"SPThunderboltDataType": [{"domain_uuid_key": "U1", "receptacle_1_tag": {"receptacle_id_key": "2"},'
            ' "_items": [{"_name": "Mac mini", "domain_uuid_key": "U2",'
            ' "receptacle_upstream_ambiguous_tag": {"current_speed_key": "Up to 80 Gb/s"}}]}]}')
    _, [port] = parse_system_profiler(text)
    assert port.speed_gbps == 80.0 and port.peer_uuid == "U2" and port.status == "connected"


def test_bus_without_receptacle_is_not_a_port():
    model, ports = parse_system_profiler('{"SPThunderboltDataType": [{"device_name_key": "MacBook Air"}]}')
    assert model == "MacBook Air" and ports == []


@pytest.mark.parametrize("name, message", [
    ("system_profiler_truncated.json", "not JSON"),
    ("system_profiler_wrong_type.json", "SPThunderboltDataType"),
    ("system_profiler_bad_speed.json", "link speed"),
])
def test_malformed_system_profiler(name, message):
    with pytest.raises(ConfigError, match=message):
        parse_system_profiler((FIXTURES / "malformed" / name).read_text())


def test_malformed_hardware_ports_and_ifconfig():
    with pytest.raises(ConfigError, match="Hardware Port"):
        parse_hardware_ports((FIXTURES / "malformed" / "hardware_ports_garbage.txt").read_text())
    with pytest.raises(ConfigError, match="flags="):
        parse_ifconfig((FIXTURES / "malformed" / "ifconfig_garbage.txt").read_text())


def test_build_host_requires_the_core_outputs():
    outputs = mac_outputs("pair", "mac-a")
    del outputs["hardware_ports"]
    with pytest.raises(ConfigError, match="hardware_ports"):
        build_macos_host("x", outputs)


def test_services_are_optional():
    outputs = mac_outputs("pair", "mac-a")
    del outputs["services"]
    host = build_macos_host("mac-a", outputs)
    assert host.services is None and host.bridge.service_enabled is None


# --- Localized Macs, TB5 on macOS 26, real-length UIDs -------------------------------------------------

def test_german_mac_finds_bridge_and_ports_by_device_not_by_english_name():
    host = mac_host("pair_de_fr", "mac-a")
    assert host.bridge is not None, "bridge0 must be found on a German Mac (service 'Thunderbolt-Brücke')"
    assert host.bridge.ifname == "bridge0" and host.bridge.service == "Thunderbolt-Brücke"
    assert host.bridge.service_enabled is True and host.bridge.members == ["en2", "en3", "en4", "en5"]
    assert [(p.name, p.ifname) for p in host.ports] == [(f"Thunderbolt {i}", f"en{i + 1}") for i in range(1, 5)]
    assert host.ports[1].has_computer and host.ports[1].link_up
    assert host.other_addresses == ["192.168.1.20/24"]  # not the bridge's 169.254 address, whatever its name


def test_french_mac_bridge_service_name():
    host = mac_host("pair_de_fr", "mac-b")
    assert host.bridge.service == "Pont Thunderbolt" and host.bridge.service_enabled is True
    assert host.services["Pont Thunderbolt"] is True and "Thunderbolt Bridge" not in host.services


def test_plan_turns_off_the_bridge_by_its_localized_service_name():
    from torch_thunderbolt.topology.report import analyse

    a = analyse(scenario_hosts("pair_de_fr"))
    off = {c.host: c.argv for c in a.commands if "-setnetworkserviceenabled" in c.argv}
    assert off == {"mac-a": ["/usr/sbin/networksetup", "-setnetworkserviceenabled", "Thunderbolt-Brücke", "off"],
                   "mac-b": ["/usr/sbin/networksetup", "-setnetworkserviceenabled", "Pont Thunderbolt", "off"]}
    deletem = [c.argv for c in a.commands if "deletem" in c.argv]
    assert deletem == [["/sbin/ifconfig", "bridge0", "deletem", "en3"], ["/sbin/ifconfig", "bridge0", "deletem", "en4"]]


def test_bridge_loop_is_found_on_german_macs():
    from torch_thunderbolt.topology.report import analyse

    a = analyse(scenario_hosts("bridge_loop_de"))
    assert a.shape == "ring" and len(a.loops) == 1


def test_tb5_macos26_pair():
    a, b = mac_host("tb5_pair", "mac-a"), mac_host("tb5_pair", "mac-b")
    assert a.ports[0].speed_text == "80 Gb/s" and a.ports[0].speed_gbps == 80.0
    assert a.ports[0].peer_uuid == b.ports[1].uuid and b.ports[1].peer_uuid == a.ports[0].uuid
    assert a.ports[0].addresses == ["10.77.0.1/30"] and b.ports[1].ifname == "en3"
    assert a.bridge.service == "Pont Thunderbolt" and a.bridge.service_enabled is False and not a.bridge.members
    from torch_thunderbolt.topology.report import analyse

    analysis = analyse([a, b])
    assert [(c.a_port, c.b_port, c.speed_gbps) for c in analysis.graph.cables] == [("en2", "en3", 80.0)]
    assert analysis.commands and all(c.satisfied for c in analysis.commands)


def test_fixture_uids_have_real_lengths():
    """Switch UIDs are 0x + 16 hex digits and bus UUIDs 36 characters, and a peer entry names its Mac's own."""
    import json
    import re

    def walk(node):
        if isinstance(node, dict):
            yield node
            for child in node.get("_items", []):
                yield from walk(child)

    buses = {}
    for path in sorted(FIXTURES.glob("*/mac-*/system_profiler.json")):
        for bus in json.loads(path.read_text())["SPThunderboltDataType"]:
            buses[bus["domain_uuid_key"]] = bus["switch_uid_key"]
            for node in walk(bus):
                assert re.fullmatch(r"0x[0-9A-F]{16}", node["switch_uid_key"]), (path, node["switch_uid_key"])
                assert "domain_uuid_key" not in node or len(node["domain_uuid_key"]) == 36
    for path in sorted(FIXTURES.glob("*/mac-*/system_profiler.json")):
        for bus in json.loads(path.read_text())["SPThunderboltDataType"]:
            for item in bus.get("_items", []):
                if item.get("domain_uuid_key"):
                    assert item["switch_uid_key"] == buses[item["domain_uuid_key"]]


def test_port_devices_by_name_or_bridge_membership():
    from torch_thunderbolt.topology.macos import Interface, thunderbolt_bridge, thunderbolt_port_devices

    hw = {"Ethernet": "en0", "Thunderbolt Ethernet Slot 1": "en9", "Ponte Thunderbolt": "bridge0",
          "Porta 2": "en3", "THUNDERBOLT 1": "en2", "Porta 7": "en7"}
    ifaces = {"bridge0": Interface("bridge0", members=["en2", "en3"]), "bridge100": Interface("bridge100")}
    assert thunderbolt_bridge(hw, ifaces) == ("Ponte Thunderbolt", "bridge0")
    # en9 is an adapter, not port 1; en7 is named like a port but is not a bridge member.
    assert thunderbolt_port_devices(hw, ifaces) == {"1": ("THUNDERBOLT 1", "en2"), "2": ("Porta 2", "en3")}
    assert thunderbolt_bridge({"Ethernet": "en0"}, {}) is None
