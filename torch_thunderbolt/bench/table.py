"""Text output: nccl-tests-style tables, the raw-link table, the progress bar. Pure string functions."""
from __future__ import annotations

from typing import Sequence

from .metrics import Result
from .sizes import format_size
from .spec import DTYPES

_COLUMNS = (
    # (header, unit, width)
    ("size", "(B)", 12), ("count", "(elements)", 13), ("type", "", 9), ("redop", "", 7), ("root", "", 6),
    ("time", "(us)", 10), ("min", "(us)", 10), ("max", "(us)", 10), ("algbw", "(GB/s)", 8),
    ("busbw", "(GB/s)", 8), ("#wrong", "", 7),
)
_RATIO_WIDTH = 11


def format_time(us: float) -> str:
    """Like nccl-tests: fewer decimals as the number grows, so columns stay narrow."""
    if us >= 10000:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def _fmt_optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _header_lines(baseline: str | None, show_eff: bool) -> list[str]:
    names = [h.rjust(w) for h, _, w in _COLUMNS]
    units = [u.rjust(w) for _, u, w in _COLUMNS]
    if baseline is not None:
        names.append("ratio".rjust(_RATIO_WIDTH))
        units.append(f"vs {baseline}"[: _RATIO_WIDTH - 1].rjust(_RATIO_WIDTH))
    if show_eff:
        names.append("eff".rjust(7))
        units.append("(link)".rjust(7))
    return ["#" + "".join(names)[1:], "#" + "".join(units)[1:]]


def format_row(r: Result, baseline: str | None, show_eff: bool) -> str:
    cells = [str(r.bytes), str(r.count), DTYPES[r.dtype].nccl_name, r.redop, str(r.root),
             format_time(r.time_us), format_time(r.time_us_min), format_time(r.time_us_max),
             f"{r.algbw_gbps:.2f}", f"{r.busbw_gbps:.2f}", str(r.wrong)]
    line = "".join(c.rjust(w) for c, (_, _, w) in zip(cells, _COLUMNS))
    if baseline is not None:
        ratio = "base" if r.backend == baseline else _fmt_optional(r.ratio)
        line += ratio.rjust(_RATIO_WIDTH)
    if show_eff:
        line += _fmt_optional(r.efficiency).rjust(7)
    return line


def format_table(rows: Sequence[Result], baseline: str | None, transport: str) -> str:
    """One nccl-tests table: one backend, one op, one row per size, with the average-busbw footer."""
    first = rows[0]
    show_eff = any(r.efficiency is not None for r in rows)
    title = (f"# {first.op} on {first.backend} ({first.backend_kind}), world_size {first.world_size}, "
             f"transport {transport}, {first.iters} iters")
    if show_eff:
        first_eff = next(r for r in rows if r.link_streams is not None)
        both = ", both directions at once" if first_eff.link_direction == "duplex" else ", one way"
        title += f"; eff = busbw / raw TCP at {first_eff.link_streams} stream(s){both}"
    lines = [title, *_header_lines(baseline, show_eff)]
    lines += [format_row(r, baseline, show_eff) for r in rows]
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
