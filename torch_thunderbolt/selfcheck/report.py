"""The selfcheck's report: `selfcheck-<date>.json` (schema: report-schema.json, docs/selfcheck.md) and the same
as Markdown, to attach to an issue. Also what goes into it about each host (`system_facts`)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..bench.sizes import format_size
from .model import REPORT_VERSION, STATUSES, Line

if TYPE_CHECKING:
    from .rank import Selfcheck

# Published RDMA-over-Thunderbolt 5 figures (shared/reference/rdma-tb5-facts.md), shown beside ours over rdma.
PUBLISHED_RDMA = (
    "ib_send_lat 64 B Mac<->Mac 4.15 us avg (hellas-ai PR #28)",
    "PyTorch RDMA prototype all_reduce 1 MiB 7.08 GB/s, 16 MiB 9.07 GB/s (pytorch PR #181087)",
    "TCCL ~7.6 GB/s per rank (pytorch PR #189856)",
)


def _first_line(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""


def _cpu() -> str:
    if sys.platform == "darwin":
        return _first_line(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for row in f:
                if row.startswith("model name"):
                    return row.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def system_facts() -> dict[str, Any]:
    """Versions and hardware of this host (read only)."""
    import torch

    from ..version import __version__

    mac = platform.mac_ver()[0]
    return {"os": f"macOS {mac}" if mac else platform.platform(), "machine": platform.machine(), "cpu": _cpu(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_thunderbolt": __version__}


def bench_summary(records: list[dict], cable_rate: str | None) -> str:
    """One sentence per size: our busbw beside gloo's, the ratio, the bound reached; over rdma the published."""
    ours = {r["bytes"]: r for r in records if r.get("backend") == "thunderbolt" and r.get("op") == "all_reduce"}
    gloo = {r["bytes"]: r for r in records if r.get("backend") == "gloo" and r.get("op") == "all_reduce"}
    parts = []
    for size in sorted(ours):
        r, g = ours[size], gloo.get(size, {})
        text = f"{format_size(size)}B {r['time_us']:.0f} us / {r['busbw_gbps']:.2f} GB/s over {r['transport']}"
        if g:
            text += f" vs gloo {g['time_us']:.0f} us ({r.get('ratio') or 0:.2f}x)"
        if r.get("bound_fraction") is not None:
            text += f", {100 * r['bound_fraction']:.0f}% of its {r['bound_kind']} bound"
        parts.append(text)
    out = "all_reduce " + "; ".join(parts)
    if cable_rate is None:
        out += "; no cable bound (cable rate unknown: pass --cable-rate)"
    if any("rdma" in str(r.get("transport")) for r in ours.values()):
        out += "; published over RDMA: " + "; ".join(PUBLISHED_RDMA)
    return out


def document(sc: "Selfcheck", stuck: str | None) -> dict[str, Any]:
    counts = {s: sum(1 for line in sc.lines if line.status == s) for s in STATUSES}
    return {
        "version": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "quick": sc.opts.quick,
        "world_size": sc.world,
        "seconds": round(time.monotonic() - sc.started, 2),
        "result": "FAIL" if stuck or counts["FAIL"] else "warn" if counts["warn"] else "ok",
        "counts": counts,
        "stopped": stuck,
        "hosts": [{k: h[k] for k in ("rank", "hostname", "os", "machine", "cpu", "python", "torch",
                                     "torch_thunderbolt", "mps")} for h in sc.hosts],
        "doctor": getattr(sc, "doctor", {}),
        "checks": [line.to_json() for line in sc.lines],
        "bench": {"records": sc.figures, "text": getattr(sc, "bench_text", ""),
                  "published_rdma": list(PUBLISHED_RDMA)},
    }


def markdown(doc: dict[str, Any]) -> str:
    out = [f"# torch-thunderbolt selfcheck: {doc['result']}", "",
           f"{doc['created']}, {doc['world_size']} ranks, {doc['seconds']} s{', quick' if doc['quick'] else ''}; "
           f"ok {doc['counts']['ok']}, warn {doc['counts']['warn']}, FAIL {doc['counts']['FAIL']}"
           + (f"; stopped: {doc['stopped']}" if doc["stopped"] else ""), "", "## Hosts", "",
           "| rank | host | os | cpu | python | torch | torch-thunderbolt | mps |", "|---|---|---|---|---|---|---|---|"]
    out += [f"| {h['rank']} | {h['hostname']} | {h['os']} | {h['cpu']} | {h['python']} | {h['torch']} | "
            f"{h['torch_thunderbolt']} | {h['mps']} |" for h in doc["hosts"]]
    out += ["", "## Interfaces", ""]
    for host, d in doc["doctor"].items():
        out.append(f"- {host}: Thunderbolt {d.get('thunderbolt_ifnames') or 'none'}; "
                   + ", ".join(f"{k} {v} (mtu {d.get('mtus', {}).get(k, '?')})" for k, v in d["interfaces"].items()))
    out += ["", "## Checks", "", "| status | check | detail | fix |", "|---|---|---|---|"]
    out += [f"| {c['status']} | {c['check']} | {c['detail']} | {c['fix']} |".replace("\n", " ") for c in doc["checks"]]
    errors = [(c["check"], e) for c in doc["checks"] for e in c["errors"]]
    if errors:
        out += ["", "## Errors in full", ""]
        for check, e in errors:
            out += [f"### {check}", "", "```", e, "```", ""]
    if doc["bench"]["text"]:
        out += ["", "## Bench", "", "```", doc["bench"]["text"].rstrip(), "```"]
    return "\n".join(out) + "\n"


def write(directory: str, doc: dict[str, Any]) -> tuple[str, str]:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    base = os.path.join(directory, f"selfcheck-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(base + ".md", "w") as f:
        f.write(markdown(doc))
    return base + ".md", base + ".json"


def schema() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath("report-schema.json").read_text())


def validate(doc: Any, sch: dict[str, Any] | None = None, where: str = "report") -> list[str]:
    """Where `doc` breaks the JSON Schema subset report-schema.json uses (type, required, properties,
    additionalProperties, items, enum, const); empty when it follows it."""
    sch = schema() if sch is None else sch
    types = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
             "boolean": bool, "null": type(None)}
    wanted = sch.get("type")
    if wanted is not None:
        allowed = wanted if isinstance(wanted, list) else [wanted]
        is_bool = isinstance(doc, bool)
        if not any(isinstance(doc, types[t]) and (t == "boolean" or not is_bool) for t in allowed):
            return [f"{where}: expected {'/'.join(allowed)}, got {type(doc).__name__}"]
    problems: list[str] = []
    if "const" in sch and doc != sch["const"]:
        problems.append(f"{where}: expected {sch['const']!r}, got {doc!r}")
    if "enum" in sch and doc not in sch["enum"]:
        problems.append(f"{where}: {doc!r} is not one of {sch['enum']}")
    if isinstance(doc, dict):
        problems += [f"{where}: lacks {k!r}" for k in sch.get("required", []) if k not in doc]
        props = sch.get("properties", {})
        for k, v in doc.items():
            if k in props:
                problems += validate(v, props[k], f"{where}.{k}")
            elif isinstance(sch.get("additionalProperties"), dict):
                problems += validate(v, sch["additionalProperties"], f"{where}.{k}")
            elif sch.get("additionalProperties") is False:
                problems.append(f"{where}: unexpected key {k!r}")
    if isinstance(doc, list) and "items" in sch:
        for i, item in enumerate(doc):
            problems += validate(item, sch["items"], f"{where}[{i}]")
    return problems
