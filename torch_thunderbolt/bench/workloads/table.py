"""Text output of `bench --workload`: one row per backend and case, in bench's table style. Pure."""
from __future__ import annotations

from typing import Sequence

from .spec import PROJECTION_LABEL

_VIT = (("backend", 14, "s"), ("exchange via", 17, "s"), ("hook", 5, "s"), ("bucket", 7, "s"), ("batch", 6, "s"),
        ("step ms", 9, "f1"), ("no-comm ms", 11, "f1"), ("exch ms", 9, "f1"), ("device ms", 10, "f1"),
        ("exposed", 8, "f2"), ("hidden", 7, "f2"), ("img/s", 8, "f1"), ("dev/wall", 8, "f2"), ("speed", 7, "x"))
_LLAMA = (("backend", 19, "s"), ("messages via", 17, "s"), ("batch", 6, "s"), ("micro", 6, "s"),
          ("ms/token", 9, "f2"), ("compute", 9, "f2"), ("comm", 9, "f2"), ("tok/s", 8, "f1"), ("dev/wall", 8, "f2"),
          ("speed", 7, "x"))
# Below this share of the no-communication phase's wall time spent busy on the modelled device, the host (the
# emulation's own per-op cost on this machine) set the pace, not the modelled GPU.
HOST_BOUND_SHARE = 0.8


def _cell(value: object, width: int, fmt: str) -> str:
    if value is None:
        text = "-"
    elif fmt == "f1":
        text = f"{value:.1f}"
    elif fmt == "f2":
        text = f"{value:.2f}"
    elif fmt == "x":
        text = f"{value:.2f}x"
    else:
        text = str(value)
    return text.rjust(width) if fmt != "s" or width < 8 else text.ljust(width)


def _format(columns: Sequence[tuple[str, int, str]], rows: Sequence[Sequence[object]]) -> str:
    head = " ".join(name.rjust(w) if (f != "s" or w < 8) else name.ljust(w) for name, w, f in columns)
    lines = [head]
    for row in rows:
        lines.append(" ".join(_cell(v, w, f) for v, (_, w, f) in zip(row, columns)))
    return "\n".join(lines)


def vit_table(records: Sequence[dict]) -> str:
    """step/no-comm/exchange: medians; device: the timed device's modelled busy time in the no-comm step;
    exposed = (step - no-comm) / step; hidden = 1 - (step - no-comm) / exchange; speed = the baseline's
    step time / this row's."""
    rows = [(r["backend"], r["how"], r["hook"], f"{r['bucket_cap_mb']:g}", r["batch"], r["step_s"] * 1e3,
             r["compute_s"] * 1e3, r["exchange_s"] * 1e3, r["device_busy_s"] * 1e3 if r["device_busy_s"] else None,
             r["exposed"], r["hidden"], r["images_per_s"], r.get("device_share") if r["device_busy_s"] else None,
             r.get("speed")) for r in records]
    return _format(_VIT, rows) + host_bound_note(records)


def llama_table(records: Sequence[dict]) -> str:
    """ms/token: the decode with its messages; compute: with none (pp: the stages' sum, one device's time;
    tp: one shard's); comm: the messages alone; speed = the baseline's ms/token / this row's."""
    rows = []
    for r in records:
        name = r["backend"] if not r.get("projection") else PROJECTION_LABEL
        share = r.get("device_share") if r.get("device_busy_ms_per_token") and not r.get("projection") else None
        rows.append((name, r["how"], r["batch"], r.get("microbatches", 1), r["ms_per_token"],
                     r["compute_ms_per_token"], r["comm_ms_per_token"], r["tokens_per_s"], share, r.get("speed")))
    return _format(_LLAMA, rows) + host_bound_note(records)


def host_bound_note(records: Sequence[dict]) -> str:
    """A warning under the table when a timed-device row was paced by the host, not by the modelled GPU."""
    bound = [r for r in records if not r.get("projection") and (r.get("device_busy_s") or
                                                                  r.get("device_busy_ms_per_token"))
             and r.get("device_share", 1.0) < HOST_BOUND_SHARE]
    if not bound:
        return ""
    return (f"\n# HOST-BOUND: in {len(bound)} row(s) dev/wall < {HOST_BOUND_SHARE}: the modelled GPU was idle most of "
            "the no-comm phase, waiting for this host to issue kernels (the emulation's own cost per op); those "
            "times measure this machine, not a Mac")


def add_speed(records: list[dict], baseline: str | None, time_key: str, case_keys: Sequence[str]) -> None:
    """`speed` = the baseline backend's time / this row's, per case (rows differing only by backend)."""
    if baseline is None:
        return

    def case(r: dict) -> tuple:
        return tuple(r.get(k) for k in case_keys)

    base = {case(r): r[time_key] for r in records if r["backend"] == baseline and not r.get("projection")}
    for r in records:
        ref = base.get(case(r))
        if ref is not None and r["backend"] != baseline and r[time_key] > 0:
            r["speed"] = ref / r[time_key]
