import ipaddress

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.topology.graph import build_graph
from torch_thunderbolt.topology.loops import find_bridge_loops
from torch_thunderbolt.topology.addressing import DEFAULT_BASE, plan_addresses, plan_commands

from .topo_fixtures import scenario_hosts


def _graph(scenario):
    return build_graph(scenario_hosts(scenario))


def test_bridge_loop_through_three_macs_is_found_with_a_fix():
    [loop] = find_bridge_loops(_graph("bridge_loop"))
    assert loop.hosts == ["mac-a", "mac-b", "mac-c"] and len(loop.cables) == 3
    assert "broadcast storm" in loop.advice and "/30" in loop.advice
    assert loop.fix[0].startswith("mac-a: remove en2, en3 from bridge0")


def test_chain_with_bridge_on_is_not_a_loop():
    assert find_bridge_loops(_graph("chain3")) == []
    assert find_bridge_loops(_graph("pair")) == []


def test_no_loop_once_bridge_is_off():
    assert find_bridge_loops(_graph("ring3")) == []


def test_two_bridged_cables_between_one_pair_are_a_loop():
    hosts = scenario_hosts("double")
    for h in hosts:
        h.bridge.members, h.bridge.active = ["en2", "en3"], True
    [loop] = find_bridge_loops(build_graph(hosts))
    assert loop.hosts == ["mac-a", "mac-b"] and "2 cables between mac-a and mac-b" in loop.advice


def test_one_subnet_per_cable_inside_the_base():
    graph = _graph("mesh4")
    plan = plan_addresses(graph)
    nets = [ipaddress.ip_network(a.network) for a in plan.assignments]
    assert len(set(nets)) == 6 and all(n.prefixlen == 30 and n.subnet_of(ipaddress.ip_network(DEFAULT_BASE))
                                       for n in nets)
    for a in plan.assignments:
        net = ipaddress.ip_network(a.network)
        assert {ipaddress.ip_address(a.a_address), ipaddress.ip_address(a.b_address)} == set(net.hosts())
    assert [ifname for ifname, _ in plan.for_host("mac-a")] == ["en2", "en3", "en4"]


def test_existing_addresses_are_kept_and_new_cables_take_free_subnets():
    hosts = scenario_hosts("ring3")
    hosts[2].ports[0].addresses = []  # mac-c en2 lost its address: that cable is replanned
    hosts[1].ports[1].addresses = []
    plan = plan_addresses(build_graph(hosts))
    kept = {a.network for a in plan.assignments if a.kept}
    assert kept == {"10.77.0.0/30", "10.77.0.4/30"}
    [new] = [a for a in plan.assignments if not a.kept]
    assert new.network == "10.77.0.8/30"  # the first free /30, not a collision with the kept ones


def test_custom_base_and_bad_bases():
    plan = plan_addresses(_graph("chain3"), "172.31.250.0/24")
    assert [a.network for a in plan.assignments] == ["172.31.250.0/30", "172.31.250.4/30"]
    for bad, msg in [("10.77.0.1/16", "not a network"), ("banana", "not a network"),
                     ("fd00::/64", "IPv4"), ("10.0.0.0/31", "IPv4 network of /30")]:
        with pytest.raises(ConfigError, match=msg):
            plan_addresses(_graph("pair"), bad)
    with pytest.raises(ConfigError, match="room for"):
        plan_addresses(_graph("mesh4"), "10.1.1.0/29")


def test_base_overlapping_a_lan_is_refused():
    with pytest.raises(ConfigError, match="overlaps 192.168.1.20/24 already used on mac-a"):
        plan_addresses(_graph("pair"), "192.168.0.0/16")


def test_commands_for_a_fresh_pair():
    graph = _graph("pair")
    cmds = [c for c in plan_commands(graph, plan_addresses(graph)) if c.host == "mac-a"]
    assert [c.argv for c in cmds] == [
        # By absolute path: sudo over ssh and a user's PATH both may not find (or find other) tools.
        ["/usr/sbin/networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"],
        ["/sbin/ifconfig", "bridge0", "deletem", "en2"],
        ["/usr/sbin/networksetup", "-createnetworkservice", "Thunderbolt 1", "Thunderbolt 1"],
        ["/usr/sbin/networksetup", "-setmanual", "Thunderbolt 1", "10.77.0.1", "255.255.255.252"],
    ]
    assert not any(c.satisfied for c in cmds)
    assert cmds[3].shell() == "sudo /usr/sbin/networksetup -setmanual 'Thunderbolt 1' 10.77.0.1 255.255.255.252"


def test_commands_already_applied_are_all_satisfied():
    graph = _graph("ring3")
    cmds = plan_commands(graph, plan_addresses(graph))
    assert cmds and all(c.satisfied for c in cmds)
    assert not any(c.argv[:2] == ["/sbin/ifconfig", "bridge0"] for c in cmds)  # nothing left in the bridge


def test_mtu_command_only_when_asked_and_unsatisfied():
    graph = _graph("ring3")
    assert not any("-setMTU" in c.argv for c in plan_commands(graph, plan_addresses(graph)))
    mtu = [c for c in plan_commands(graph, plan_addresses(graph), mtu=9000) if "-setMTU" in c.argv]
    assert len(mtu) == 6 and not any(c.satisfied for c in mtu)
    assert all(c.satisfied for c in plan_commands(graph, plan_addresses(graph), mtu=1500) if "-setMTU" in c.argv)


def test_disabled_port_service_is_enabled():
    hosts = scenario_hosts("ring3")
    hosts[0].services["Thunderbolt 1"] = False
    graph = build_graph(hosts)
    cmds = [c.argv for c in plan_commands(graph, plan_addresses(graph)) if not c.satisfied]
    assert cmds == [["/usr/sbin/networksetup", "-setnetworkserviceenabled", "Thunderbolt 1", "on"]]


def test_linux_commands():
    graph = build_graph(scenario_hosts("linux_pair"))
    cmds = plan_commands(graph, plan_addresses(graph))
    a = [(c.argv, c.satisfied) for c in cmds if c.host == "nuc-a"]
    b = [(c.argv, c.satisfied) for c in cmds if c.host == "nuc-b"]
    # nuc-b already has 10.77.0.2/30 but nuc-a has nothing: the cable is planned fresh, same subnet
    assert a == [(["ip", "addr", "replace", "10.77.0.1/30", "dev", "thunderbolt0"], False),
                 (["ip", "link", "set", "thunderbolt0", "up"], True)]
    assert b[0] == (["ip", "addr", "replace", "10.77.0.2/30", "dev", "thunderbolt0"], True)


@pytest.mark.parametrize("mtu", [0, 100, 70000])
def test_bad_mtu(mtu):
    graph = _graph("pair")
    with pytest.raises(ConfigError, match="--mtu"):
        plan_commands(graph, plan_addresses(graph), mtu=mtu)
