import ipaddress

import pytest

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.lab.blueprint import parse_rate, plan_lab, tbf_burst_bytes, teardown_commands


def _cmds(plan):
    return [" ".join(c) for c in plan.commands]


def test_chain3_plan_matches_the_documented_lab():
    plan = plan_lab(3, "chain", 1, "10gbit", None, name="t1")
    assert plan.hosts == ["mac0", "mac1", "mac2"]
    assert plan.namespaces == ["t1-mac0", "t1-mac1", "t1-mac2"]
    c0, c1 = plan.cables
    assert (c0.a, c0.b, c0.subnet, c0.addr_a, c0.addr_b) == (0, 1, "10.213.0.0/30", "10.213.0.1", "10.213.0.2")
    assert (c0.ifname_a, c0.ifname_b) == ("tb1_0", "tb0_0")
    assert (c1.ifname_a, c1.ifname_b) == ("tb2_0", "tb1_0")
    cmds = _cmds(plan)
    assert cmds[:2] == ["ip netns add t1-mac0", "ip -n t1-mac0 link set dev lo up"]
    assert "ip link add tb1_0 netns t1-mac0 type veth peer name tb0_0 netns t1-mac1" in cmds
    assert "ip -n t1-mac0 route add 10.213.0.4/30 via 10.213.0.2 dev tb1_0" in cmds
    assert "ip -n t1-mac2 route add 10.213.0.0/30 via 10.213.0.5 dev tb1_0" in cmds
    assert [c for c in cmds if "ip_forward" in c] == ["ip netns exec t1-mac1 sysctl -qw net.ipv4.ip_forward=1"]
    tbf = [c for c in cmds if " tbf " in c]
    assert len(tbf) == 4 and all("rate 10gbit" in c for c in tbf)  # both ends of both cables


def test_commands_create_before_use():
    plan = plan_lab(4, "ring", 2, "5gbit", 9000, name="t2", cc="reno")
    seen_ns: set[str] = set()
    for argv in plan.commands:
        if argv[:3] == ["ip", "netns", "add"]:
            seen_ns.add(argv[3])
        elif "-n" in argv:
            assert argv[argv.index("-n") + 1] in seen_ns
    cmds = _cmds(plan)
    assert sum("tcp_congestion_control=reno" in c for c in cmds) == 4
    assert all("mtu 9000 up" in c for c in cmds if " link set dev tb" in c)


@pytest.mark.parametrize("topology,hosts,cables", [("pair", 2, 3), ("chain", 5, 1), ("ring", 6, 2),
                                                    ("mesh", 5, 2)])
def test_addresses_and_names_are_unique_and_valid(topology, hosts, cables):
    plan = plan_lab(hosts, topology, cables, None, None, name="t3")
    addrs = [a for c in plan.cables for a in (c.addr_a, c.addr_b)]
    assert len(set(addrs)) == len(addrs)
    for c in plan.cables:
        net = ipaddress.ip_network(c.subnet)
        assert net.prefixlen == 30 and ipaddress.ip_address(c.addr_a) in net and ipaddress.ip_address(c.addr_b) in net
    for h in range(hosts):
        names = [c.ifname_a for c in plan.cables if c.a == h] + [c.ifname_b for c in plan.cables if c.b == h]
        assert len(set(names)) == len(names) and all(len(n) <= 15 for n in names)
    assert not any(" tbf " in c for c in _cmds(plan))  # rate None: unshaped


def test_k_cables_between_a_pair():
    plan = plan_lab(2, "pair", 3, None, None, name="t4")
    assert [(c.k, c.ifname_a, c.ifname_b) for c in plan.cables] == [
        (0, "tb1_0", "tb0_0"), (1, "tb1_1", "tb0_1"), (2, "tb1_2", "tb0_2")]
    assert plan.routes == [] and plan.forwarders == []


def test_largest_lab_fits_interface_names():
    plan = plan_lab(64, "chain", 8, None, None, name="big")
    assert max(len(c.ifname_a) for c in plan.cables) <= 15


@pytest.mark.parametrize("kwargs,needle", [
    (dict(cables=0), "--cables"), (dict(cables=9), "--cables"), (dict(mtu=20), "--mtu"),
    (dict(rate="10G"), "expected e.g. 10gbit"), (dict(rate="fast"), "expected e.g. 10gbit"),
    (dict(cc="vegas"), "--cc"), (dict(name="Bad_Name"), "lab name"), (dict(name="x" * 30), "lab name"),
    (dict(base="8.8.0.0/16"), "private"), (dict(base="10.1.0.0/29"), "holds 2 cables"),
    (dict(base="nonsense"), "address base"),
])
def test_bad_arguments_raise_config_errors(kwargs, needle):
    args = dict(hosts=4, topology="mesh", cables=1, rate=None, mtu=None)
    extra = {k: kwargs.pop(k) for k in ("name", "cc", "base") if k in kwargs}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=needle):
        plan_lab(**args, **extra)


def test_parse_rate():
    assert parse_rate("10gbit") == ("10gbit", 10**10)
    assert parse_rate("2.5Gbit") == ("2.5gbit", 2_500_000_000)
    assert parse_rate("none") == (None, 0) and parse_rate(None) == (None, 0)


def test_tbf_burst_scales_with_rate_and_holds_gso_packets():
    assert tbf_burst_bytes(10**10) == 625_000  # 0.5 ms at the rate
    assert tbf_burst_bytes(10**9) == 4 * 65536  # 0.5 ms would be 62.5 KB, less than one GSO packet
    assert tbf_burst_bytes(3 * 10**8) == 4 * 65536


def test_teardown_deletes_each_namespace():
    assert teardown_commands(["a-mac0", "a-mac1"]) == [["ip", "netns", "del", "a-mac0"],
                                                       ["ip", "netns", "del", "a-mac1"]]
