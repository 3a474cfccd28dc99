import pytest
from hypothesis import given, settings, strategies as st

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.lab.cabling import forwarding_hosts, next_hops, subnet_routes, topology_edges


def test_edges_per_topology():
    assert topology_edges(2, "pair") == [(0, 1)]
    assert topology_edges(4, "chain") == [(0, 1), (1, 2), (2, 3)]
    assert topology_edges(4, "ring") == [(0, 1), (1, 2), (2, 3), (0, 3)]
    assert len(topology_edges(5, "mesh")) == 10


@pytest.mark.parametrize("hosts,topology,needle", [
    (3, "pair", "exactly 2"), (2, "ring", "at least 3"), (1, "chain", "from 2"),
    (65, "mesh", "from 2"), (3, "star", "expected one of"),
])
def test_bad_topologies_name_what_was_expected(hosts, topology, needle):
    with pytest.raises(ConfigError, match=needle):
        topology_edges(hosts, topology)


def test_chain_routes_go_through_the_middle():
    edges = topology_edges(3, "chain")
    assert subnet_routes(3, edges) == [{1: 1}, {}, {0: 1}]
    assert forwarding_hosts(3, edges) == [1]
    dist, first = next_hops(3, edges, 0)
    assert dist == [0, 1, 2] and first == [-1, 1, 1]


def test_pair_needs_no_forwarding():
    assert forwarding_hosts(2, topology_edges(2, "pair")) == []


def _deliver(hosts, edges, routes, src, edge, dst):
    """Hop-by-hop walk of a packet from src to host dst's address on cable `edge`; -> path or None."""
    a, b = edges[edge]
    path, node = [src], src
    while node != dst:
        node = dst if node in (a, b) else routes[node].get(edge)
        if node is None or len(path) > hosts:
            return None
        path.append(node)
    return path


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["chain", "ring", "mesh"]), st.integers(3, 9))
def test_every_address_is_reachable_from_every_host(topology, hosts):
    edges = topology_edges(hosts, topology)
    routes = subnet_routes(hosts, edges)
    forwarders = set(forwarding_hosts(hosts, edges))
    for src in range(hosts):
        for e, (a, b) in enumerate(edges):
            for dst in (a, b):
                path = _deliver(hosts, edges, routes, src, e, dst)
                assert path is not None, (src, e, dst)
                # Each hop must be a cable, and every host in the middle must forward.
                assert all((min(x, y), max(x, y)) in edges for x, y in zip(path, path[1:]))
                assert set(path[1:-1]) <= forwarders
