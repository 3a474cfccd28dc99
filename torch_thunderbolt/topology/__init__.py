"""Thunderbolt topology: discover ports and cables, check for bridge loops, plan addresses, draw the graph.

Pure helpers the core can use: `link_speed_gbps`, `build_graph`, `classify`, `ring_order`, `chain_order`,
`best_order`, `order_cables`. Parsing and planning are pure; discovery and ssh go through a `run` seam.
"""
from .graph import best_order, build_graph, chain_order, classify, order_cables, ring_order
from .model import Bridge, Cable, ClusterGraph, Host, Port, load_host_dump
from .speed import link_speed_gbps

__all__ = [
    "Bridge", "Cable", "ClusterGraph", "Host", "Port", "best_order", "build_graph", "chain_order",
    "classify", "link_speed_gbps", "load_host_dump", "order_cables", "ring_order",
]
