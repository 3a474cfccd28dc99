"""Text output: nccl-tests-style tables, the raw-link table, the progress bar. Pure string functions."""
from __future__ import annotations

from typing import Sequence

from .bounds import CABLES, MEMCPY, TCP_LINK
from .metrics import Result
from .sizes import format_size
from .spec import DTYPES, NULL_BACKEND

_COLUMNS = (
    # (header, unit, width)
    ("size", "(B)", 12), ("count", "(elements)", 13), ("type", "", 9), ("redop", "", 7), ("root", "", 6),
    ("time", "(us)", 10), ("min", "(us)", 10), ("max", "(us)", 10), ("algbw", "(GB/s)", 8),
    ("busbw", "(GB/s)", 8), ("#wrong", "", 7),
)
_RATIO_WIDTH = 11
_FLOOR_WIDTH = 9
_BOUND_WIDTH = 9
_BOUND_UNITS = {CABLES: "(cables)", TCP_LINK: "(link)", MEMCPY: "(memcpy)"}


def format_time(us: float) -> str:
    """Like nccl-tests: fewer decimals as the number grows, so columns stay narrow."""
    if us >= 10000:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def _fmt_optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_multiple(x: float | None) -> str:
    """The "x floor" cell: 3 significant figures or so, whether 1.23 or 1234."""
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def is_floor(r: Result) -> bool:
    return r.backend_kind == NULL_BACKEND


def _columns(rows: Sequence[Result]) -> tuple[bool, bool, bool]:
    """Which optional columns a table has: x floor, eff, bound. eff is left out where the bound column
    already shows it (one host over TCP: the bound is the raw link)."""
    show_floor = any(r.floor_us is not None and not is_floor(r) for r in rows)
    show_eff = any(r.efficiency is not None and r.bound_kind != TCP_LINK for r in rows)
    show_bound = any(r.bound_kind is not None for r in rows)
    return show_floor, show_eff, show_bound


def _header_lines(baseline: str | None, show_eff: bool, show_floor: bool = False,
                  bound_kind: str | None = None) -> list[str]:
    names = [h.rjust(w) for h, _, w in _COLUMNS]
    units = [u.rjust(w) for _, u, w in _COLUMNS]
    if baseline is not None:
        names.append("ratio".rjust(_RATIO_WIDTH))
        units.append(f"vs {baseline}"[: _RATIO_WIDTH - 1].rjust(_RATIO_WIDTH))
    if show_floor:
        names.append("x floor".rjust(_FLOOR_WIDTH))
        units.append("(time)".rjust(_FLOOR_WIDTH))
    if show_eff:
        names.append("eff".rjust(7))
        units.append("(link)".rjust(7))
    if bound_kind is not None:
        names.append("bound".rjust(_BOUND_WIDTH))
        units.append(_BOUND_UNITS.get(bound_kind, "")[: _BOUND_WIDTH - 1].rjust(_BOUND_WIDTH))
    return ["#" + "".join(names)[1:], "#" + "".join(units)[1:]]


def format_row(r: Result, baseline: str | None, show_eff: bool, show_floor: bool = False,
               show_bound: bool = False) -> str:
    floor = is_floor(r)  # moves nothing: bandwidths are meaningless and nothing was checked
    cells = [str(r.bytes), str(r.count), DTYPES[r.dtype].nccl_name, r.redop, str(r.root),
             format_time(r.time_us), format_time(r.time_us_min), format_time(r.time_us_max),
             "-" if floor else f"{r.algbw_gbps:.2f}", "-" if floor else f"{r.busbw_gbps:.2f}",
             "-" if floor else str(r.wrong)]
    line = "".join(c.rjust(w) for c, (_, _, w) in zip(cells, _COLUMNS))
    if baseline is not None:
        ratio = "base" if r.backend == baseline else _fmt_optional(r.ratio)
        line += ratio.rjust(_RATIO_WIDTH)
    if show_floor:
        line += format_multiple(r.x_floor).rjust(_FLOOR_WIDTH)
    if show_eff:
        line += _fmt_optional(r.efficiency).rjust(7)
    if show_bound:
        line += _fmt_optional(r.bound_fraction).rjust(_BOUND_WIDTH)
    return line


def format_table(rows: Sequence[Result], baseline: str | None, transport: str) -> str:
    """One nccl-tests table: one backend, one op, one row per size, with the average-busbw footer."""
    first = rows[0]
    if is_floor(first) and baseline != first.backend:
        baseline = None  # no ratio for the floor: it is not compared unless it is the baseline
    show_floor, show_eff, show_bound = _columns(rows)
    title = (f"# {first.op} on {first.backend} ({first.backend_kind}), world_size {first.world_size}, "
             f"transport {transport}, {first.iters} iters")
    if is_floor(first):
        title += ("; the dispatch floor: a Python process group that moves nothing (busbw meaningless, "
                  "results not checked)")
    if show_floor:
        title += "; x floor = time / the floor's"
    if show_eff:
        first_eff = next(r for r in rows if r.link_streams is not None)
        both = ", both directions at once" if first_eff.link_direction == "duplex" else ", one way"
        title += f"; eff = busbw / raw TCP at {first_eff.link_streams} stream(s){both}"
    bounded = next((r for r in rows if r.bound_kind is not None), None)
    if bounded is not None and bounded.bound_gbps is not None:
        title += f"; bound = busbw / {bounded.bound_gbps:.3g} GB/s: {bounded.bound_desc}"
    lines = [title, *_header_lines(baseline, show_eff, show_floor, bounded.bound_kind if bounded else None)]
    lines += [format_row(r, baseline, show_eff, show_floor, show_bound) for r in rows]
    if is_floor(first):
        lines.append("# Out of bounds values : not checked (the floor computes nothing)")
        return "\n".join(lines)
    wrong = sum(r.wrong for r in rows)
    avg = sum(r.busbw_gbps for r in rows) / len(rows)
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {avg:.3f} GB/s")
    return "\n".join(lines)


def format_link(records: Sequence[dict], latency: dict | None, address: str, nbytes: int, repeats: int) -> str:
    """The raw TCP path between rank 0 and rank 1: GB/s per stream count, then ping-pong latency."""
    lines = [f"# raw TCP link rank 0 -> rank 1 at {address}: {format_size(nbytes)}B per measurement, "
             f"median of {repeats}",
             "#" + "".join(h.rjust(w) for h, w in (("streams", 8), ("GB/s", 9), ("Gbit/s", 9),
                                                    ("min GB/s", 10), ("max GB/s", 10), ("cc", 8),
                                                    ("duplex GB/s", 13)))[1:]]
    for rec in records:
        duplex = rec.get("duplex_gbps")
        lines.append("".join(c.rjust(w) for c, w in (
            (str(rec["streams"]), 8), (f"{rec['gbps']:.2f}", 9), (f"{rec['gbps'] * 8:.1f}", 9),
            (f"{rec['gbps_min']:.2f}", 10), (f"{rec['gbps_max']:.2f}", 10), (rec.get("congestion_control") or "?", 8),
            (f"{duplex:.2f}" if duplex else "-", 13))))
    lines.append("# duplex: GB/s per direction with both ranks sending at once (the ceiling for all_reduce, "
                 "all_gather, reduce_scatter, all_to_all)")
    if latency is not None:
        lines.append(f"# ping-pong one-way latency (RTT/2, {latency['bytes']} B, {latency['iters']} round trips): "
                     f"median {latency['latency_us']:.1f} us, p10 {latency['latency_us_p10']:.1f}, "
                     f"p90 {latency['latency_us_p90']:.1f}")
    return "\n".join(lines)


def format_progress(done: int, total: int, label: str, width: int = 24) -> str:
    """A one-line bar redrawn in place with a carriage return (the caller writes it to a terminal)."""
    total = max(total, 1)
    filled = min(width, width * done // total)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"[:100].ljust(100)
