"""Statistics over timed iterations and the derived result rows. Pure."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from . import spec
from .bounds import Bound, link_rate


@dataclass(frozen=True)
class Stats:
    median: float
    minimum: float
    maximum: float
    p10: float
    p90: float
    samples: int


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def summarize(values: Sequence[float]) -> Stats:
    ordered = sorted(values)
    return Stats(percentile(ordered, 50), ordered[0], ordered[-1], percentile(ordered, 10),
                 percentile(ordered, 90), len(ordered))


def max_over_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Iteration i took as long as its slowest rank: the op is done only when every rank is done."""
    return [max(column) for column in zip(*per_rank)]


def hidden_share(compute: float, step: float, exchange: float) -> float:
    """How much of DDP's gradient exchange a training step hides behind its backward pass, from one
    iteration's phases: 1 when the exchange costs the step nothing, 0 when it is paid in full on top
    (clamped: timing noise can put a phase slightly outside)."""
    if exchange <= 0:
        return 0.0
    return max(0.0, min(1.0, (compute + exchange - step) / exchange))


@dataclass
class Result:
    """One row of a table and one JSON record: a backend running an op at one size."""
    backend: str
    backend_kind: str
    op: str
    bytes: int
    count: int
    world_size: int
    dtype: str
    transport: str
    time_us: float
    time_us_min: float
    time_us_max: float
    time_us_p10: float
    time_us_p90: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    iters: int
    redop: str = "none"
    root: int = -1
    ratio: float | None = None       # speed vs the baseline backend, > 1 = this one is faster
    efficiency: float | None = None  # busbw / raw TCP link throughput at the backend's stream count
    link_streams: int | None = None
    link_direction: str | None = None  # "duplex" (both ranks sending at once) or "one-way"
    floor_us: float | None = None    # the null backend's time at this op and size (--floor)
    x_floor: float | None = None     # time / floor_us: how many dispatches into a Python group this costs
    bound_gbps: float | None = None  # the busbw this row could reach at best (bounds.py)
    bound_fraction: float | None = None  # busbw / bound_gbps
    bound_kind: str | None = None    # "cables", "tcp_link" or "memcpy"
    bound_desc: str | None = None    # the bound in words, e.g. "2 cables x 1 Gbit/s per rank (ring of 3)"
    extra: dict = field(default_factory=dict)

    def record(self) -> dict:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data


def make_result(backend: str, kind: str, op: str, lay: spec.Layout, world_size: int, dtype: str,
                transport: str, times_us: Sequence[float], wrong: int) -> Result:
    stats = summarize(times_us)
    algbw = spec.algbw_gbps(lay.nbytes, stats.median)
    return Result(
        backend=backend, backend_kind=kind, op=op, bytes=lay.nbytes, count=lay.count, world_size=world_size,
        dtype=dtype, transport=transport, time_us=stats.median, time_us_min=stats.minimum,
        time_us_max=stats.maximum, time_us_p10=stats.p10, time_us_p90=stats.p90, algbw_gbps=algbw,
        busbw_gbps=algbw * spec.busbw_factor(op, world_size), wrong=wrong, iters=stats.samples,
        redop=spec.redop(op), root=spec.root(op))


def add_ratios(results: list[Result], baseline: str | None) -> None:
    """Fill `ratio` = baseline time / own time for every (op, bytes) the baseline also measured."""
    if baseline is None:
        return
    base = {(r.op, r.bytes): r for r in results if r.backend == baseline}
    for r in results:
        ref = base.get((r.op, r.bytes))
        if r.backend == baseline or ref is None or r.wrong or ref.wrong or r.time_us <= 0:
            continue  # a wrong result is an error, not a number to compare
        if r.backend_kind == spec.NULL_BACKEND:
            continue  # the floor is not a backend to compare (unless it is the baseline, asked for by name)
        r.ratio = ref.time_us / r.time_us


def add_efficiency(results: list[Result], link: dict[int, dict], streams_of: dict[str, int]) -> None:
    """Fill `efficiency` = busbw / raw link GB/s at the stream count each backend uses: the duplex rate
    (per direction, both sending) for symmetric ops, the one-way rate for broadcast and sendrecv."""
    for r in results:
        streams = streams_of.get(r.backend)
        rec = link.get(streams) if streams is not None else None
        if not rec or r.wrong:
            continue
        found = link_rate(r.op, rec)
        if found:
            r.efficiency = r.busbw_gbps / found[0]
            r.link_streams = streams
            r.link_direction = found[1]


def add_floor(results: list[Result], floor: str) -> None:
    """Fill `floor_us` (the `floor` backend's time at the same op and size) and `x_floor` = own time /
    floor time for every other row; a wrong result gets no multiple (it is an error, not a number)."""
    base = {(r.op, r.bytes): r for r in results if r.backend == floor}
    for r in results:
        ref = base.get((r.op, r.bytes))
        if ref is None:
            continue
        r.floor_us = ref.time_us
        if r.backend != floor and not r.wrong and ref.time_us > 0:
            r.x_floor = r.time_us / ref.time_us


def add_bounds(results: list[Result], bound_of: Mapping[str, Bound | None]) -> None:
    """Name each row's bound (`bound_of[backend label]`, this op's) and the fraction of it the row reaches;
    a wrong result keeps the bound's name but gets no fraction."""
    for r in results:
        bound = bound_of.get(r.backend)
        if bound is None:
            continue
        r.bound_gbps, r.bound_kind, r.bound_desc = bound.gbps, bound.kind, bound.description
        if not r.wrong and bound.gbps > 0:
            r.bound_fraction = r.busbw_gbps / bound.gbps

