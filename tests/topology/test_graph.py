import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_thunderbolt.errors import ConfigError
from torch_thunderbolt.topology import (Cable, ClusterGraph, Host, best_order, build_graph, chain_order,
                                        classify, order_cables, ring_order)

from .topo_fixtures import scenario_hosts


def _ends(graph):
    return [(c.a_host, c.a_port, c.b_host, c.b_port) for c in graph.cables]


@pytest.mark.parametrize("scenario, shape, cables", [
    ("pair", "pair", 1), ("chain3", "chain", 2), ("ring3", "ring", 3), ("mesh4", "mesh", 6),
    ("double", "pair", 2), ("bridge_loop", "ring", 3),
])
def test_scenarios_classify(scenario, shape, cables):
    graph = build_graph(scenario_hosts(scenario))
    assert classify(graph) == shape and len(graph.cables) == cables and graph.warnings == []


def test_cables_name_the_ports_at_both_ends():
    assert _ends(build_graph(scenario_hosts("chain3"))) == [
        ("mac-a", "en2", "mac-b", "en2"), ("mac-b", "en3", "mac-c", "en2")]
    assert _ends(build_graph(scenario_hosts("double"))) == [
        ("mac-a", "en2", "mac-b", "en2"), ("mac-a", "en3", "mac-b", "en3")]
    ring = build_graph(scenario_hosts("ring3"))
    assert ("mac-a", "en3", "mac-c", "en3") in _ends(ring)
    assert {c.speed_gbps for c in ring.cables} == {120.0}


def test_display_and_drive_make_no_cable():
    graph = build_graph(scenario_hosts("pair"))
    assert all(c.a_port == "en2" and c.b_port == "en2" for c in graph.cables)


def test_missing_dump_gives_a_warning_not_a_cable():
    hosts = scenario_hosts("chain3")[:2]  # mac-c's dump missing: mac-b:en3 leads nowhere we know
    graph = build_graph(hosts)
    assert len(graph.cables) == 1 and classify(graph) == "pair"
    assert len(graph.warnings) == 1 and "mac-b:en3" in graph.warnings[0] and "not in this cluster" in graph.warnings[0]


def test_duplicate_names_rejected():
    host = scenario_hosts("pair")[0]
    with pytest.raises(ConfigError, match="mac-a"):
        build_graph([host, host])


def test_orders_on_fixtures():
    assert ring_order(build_graph(scenario_hosts("ring3"))) == ["mac-a", "mac-b", "mac-c"]
    assert ring_order(build_graph(scenario_hosts("chain3"))) is None
    assert chain_order(build_graph(scenario_hosts("chain3"))) == ["mac-a", "mac-b", "mac-c"]
    assert best_order(build_graph(scenario_hosts("chain3"))) == ("chain", ["mac-a", "mac-b", "mac-c"])
    assert best_order(build_graph(scenario_hosts("mesh4")))[0] == "ring"
    assert ring_order(build_graph(scenario_hosts("pair"))) == ["mac-a", "mac-b"]
    double = build_graph(scenario_hosts("double"))
    assert [len(cs) for cs in order_cables(double, ["mac-a", "mac-b"], closed=True)] == [2]


def _graph(n, edges):
    names = [f"h{i}" for i in range(n)]
    return ClusterGraph([Host(name) for name in names], [Cable(f"h{a}", "p", f"h{b}", "q") for a, b in edges])


def test_chain_order_finds_a_path_from_the_middle_out():
    star_path = _graph(4, [(1, 0), (1, 2), (2, 3)])  # path 0-1-2-3 but h0 is an end
    assert chain_order(star_path) == ["h0", "h1", "h2", "h3"]
    star = _graph(4, [(0, 1), (0, 2), (0, 3)])
    assert chain_order(star) is None and ring_order(star) is None and best_order(star) is None
    assert classify(star) == "other"


def test_shapes_of_small_graphs():
    assert classify(_graph(1, [])) == "single" and ring_order(_graph(1, [])) == ["h0"]
    assert classify(_graph(3, [(0, 1)])) == "other"  # h2 not cabled to anything
    assert classify(_graph(4, [(0, 1), (1, 2), (2, 3), (3, 0)])) == "ring"
    assert classify(_graph(4, [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)])) == "other"
    assert ring_order(_graph(2, [])) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=3, max_value=7).flatmap(
    lambda n: st.tuples(st.just(n), st.sets(st.sampled_from(list(itertools.combinations(range(n), 2)))))))
def test_orders_follow_cables_and_agree_with_brute_force(case):
    n, edges = case
    graph = _graph(n, sorted(edges))
    adjacent = lambda a, b: bool(graph.cables_between(a, b))  # noqa: E731
    perms = [list(p) for p in itertools.permutations(graph.names)]
    has_cycle = any(all(adjacent(p[i], p[(i + 1) % n]) for i in range(n)) for p in perms)
    has_path = any(all(adjacent(p[i], p[i + 1]) for i in range(n - 1)) for p in perms)
    ring, chain = ring_order(graph), chain_order(graph)
    assert (ring is not None) == has_cycle and (chain is not None) == has_path
    if ring:
        assert sorted(ring) == graph.names and all(adjacent(ring[i], ring[(i + 1) % n]) for i in range(n))
    if chain:
        assert sorted(chain) == graph.names and all(adjacent(chain[i], chain[i + 1]) for i in range(n - 1))
