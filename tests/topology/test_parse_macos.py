import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.topology import link_speed_gbps
from torch_thunderbolt.topology.macos import (build_macos_host, parse_hardware_ports, parse_ifconfig,
                                               parse_network_services, parse_system_profiler)

from topo_fixtures import FIXTURES, mac_host, mac_outputs


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
