"""Pictures of the cluster graph: DOT text (always) and PNG (when matplotlib is installed)."""
from __future__ import annotations

import math
from pathlib import Path

from ..extras import require_matplotlib
from .loops import BridgeLoop
from .model import Cable, ClusterGraph
from .addressing import AddressPlan


def _q(text: str) -> str:
    """A DOT quoted string; newlines become DOT's centred line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _loop_cables(loops: list[BridgeLoop]) -> set[int]:
    return {id(c) for loop in loops for c in loop.cables}


def _subnets(plan: AddressPlan | None) -> dict[int, str]:
    return {id(a.cable): a.network for a in plan.assignments} if plan else {}


def _end_labels(cable: Cable, plan: AddressPlan | None) -> tuple[str, str]:
    """Port names, with the planned address under each when there is a plan."""
    for a in plan.assignments if plan else ():
        if a.cable is cable:
            return f"{cable.a_port}\n{a.a_address}", f"{cable.b_port}\n{a.b_address}"
    return cable.a_port, cable.b_port


def to_dot(graph: ClusterGraph, plan: AddressPlan | None = None, loops: list[BridgeLoop] = ()) -> str:
    """Undirected DOT graph: one node per host, one edge per cable labelled with ports/speed/subnet."""
    looped, nets = _loop_cables(list(loops)), _subnets(plan)
    lines = ["graph thunderbolt {", "  layout=circo;", "  node [shape=box, style=rounded, fontname=Helvetica];",
             "  edge [fontname=Helvetica, fontsize=10];"]
    for h in graph.hosts:
        label = h.name + (f"\n{h.model}" if h.model else "")
        lines.append(f"  {_q(h.name)} [label={_q(label)}];")
    for c in graph.cables:
        label = " ".join(x for x in (f"{c.speed_gbps:g} Gb/s" if c.speed_gbps else "", nets.get(id(c), "")) if x)
        attrs = [f"taillabel={_q(c.a_port)}", f"headlabel={_q(c.b_port)}", f"label={_q(label)}"]
        if id(c) in looped:
            attrs += ["color=red", "penwidth=2", 'xlabel="bridge loop"']
        lines.append(f"  {_q(c.a_host)} -- {_q(c.b_host)} [{', '.join(attrs)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _positions(names: list[str]) -> dict[str, tuple[float, float]]:
    n = len(names)
    if n == 1:
        return {names[0]: (0.0, 0.0)}
    if n == 2:
        return {names[0]: (-1.0, 0.0), names[1]: (1.0, 0.0)}
    return {name: (math.cos(math.pi / 2 + 2 * math.pi * i / n), math.sin(math.pi / 2 + 2 * math.pi * i / n))
            for i, name in enumerate(names)}


def require_png() -> None:
    """ConfigError unless write_png can draw: `topo` calls it before doing anything else."""
    require_matplotlib("--png", " (or use --dot)")


def write_png(path: str | Path, graph: ClusterGraph, plan: AddressPlan | None = None,
              loops: list[BridgeLoop] = (), order: list[str] | None = None, title: str = "") -> None:
    require_png()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch
    pos = _positions(order or graph.names)
    looped, nets = _loop_cables(list(loops)), _subnets(plan)
    flat = len(pos) <= 2
    fig, ax = plt.subplots(figsize=(7, 3) if flat else (7, 5.5))
    placed: list[tuple[float, float]] = []
    for pair_cables in _group(graph.cables).values():
        for k, cable in enumerate(pair_cables):
            rad = 0.0 if len(pair_cables) == 1 else 0.25 * (k - (len(pair_cables) - 1) / 2)
            _draw_cable(ax, FancyArrowPatch, pos, cable, rad, id(cable) in looped, nets.get(id(cable), ""),
                        _end_labels(cable, plan), placed)
    for h in graph.hosts:
        x, y = pos[h.name]
        ax.text(x, y, h.name + (f"\n{h.model}" if h.model else ""), ha="center", va="center", fontsize=11,
                zorder=3, bbox=dict(boxstyle="round,pad=0.6", fc="#e8f0fe", ec="#3c5a99", lw=1.5))
    ax.set_xlim(-1.7, 1.7)
    ax.set_ylim(*((-0.6, 0.6) if flat else (-1.0 if len(pos) == 3 else -1.5, 1.4)))
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"Thunderbolt cluster: {len(graph.hosts)} hosts, {len(graph.cables)} cables")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _group(cables: list[Cable]) -> dict[frozenset, list[Cable]]:
    groups: dict[frozenset, list[Cable]] = {}
    for c in cables:
        groups.setdefault(frozenset(c.hosts), []).append(c)
    return groups


def _on_arc(x1: float, y1: float, x2: float, y2: float, rad: float, t: float) -> tuple[float, float]:
    """Point at parameter t on matplotlib's arc3 curve (a quadratic Bezier bulging by rad)."""
    bulge = 2 * t * (1 - t)
    return x1 + t * (x2 - x1) + bulge * rad * (y2 - y1), y1 + t * (y2 - y1) - bulge * rad * (x2 - x1)


def _draw_cable(ax, patch_cls, pos, cable: Cable, rad: float, looped: bool, subnet: str,
                ends: tuple[str, str], placed: list[tuple[float, float]]) -> None:
    (x1, y1), (x2, y2) = pos[cable.a_host], pos[cable.b_host]
    color = "#d62728" if looped else "#555555"
    ax.add_patch(patch_cls((x1, y1), (x2, y2), arrowstyle="-", connectionstyle=f"arc3,rad={rad}",
                           color=color, lw=2.5 if looped else 1.8, zorder=1))
    mx, my = _on_arc(x1, y1, x2, y2, rad, 0.5)
    if any(abs(mx - px) < 0.45 and abs(my - py) < 0.2 for px, py in placed):  # a mesh's crossing diagonals
        my += 0.22
    placed.append((mx, my))
    text = "\n".join(x for x in (f"{cable.speed_gbps:g} Gb/s" if cable.speed_gbps else "", subnet,
                                 "BRIDGE LOOP" if looped else "") if x)
    if text:
        ax.text(mx, my, text, ha="center", va="center", fontsize=8, color=color, zorder=2,
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.9))
    # Port names sit near their own host, following the arc's bulge (sign flips for the far end).
    for (hx, hy), (ox, oy), port, sign in (((x1, y1), (x2, y2), ends[0], 1), ((x2, y2), (x1, y1), ends[1], -1)):
        tx = hx + 0.3 * (ox - hx) + sign * rad * 0.42 * (oy - hy)
        ty = hy + 0.3 * (oy - hy) - sign * rad * 0.42 * (ox - hx)
        ax.text(tx, ty, port, ha="center", va="center", fontsize=8, color="#1f4e9a", zorder=2,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
