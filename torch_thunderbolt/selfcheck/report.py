"""The selfcheck's report: `selfcheck-<date>.json` (schema: report-schema.json, docs/selfcheck.md) and the same
as Markdown, to attach to an issue. Also what goes into it about each host (`system_facts`)."""
from __future__ import annotations

import dataclasses
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
from .model import REPORT_VERSION, Findings, counts, summary

if TYPE_CHECKING:
    from ..doctor import Facts, Finding

# Published RDMA-over-Thunderbolt 5 figures between two Macs, measured by their sources (ib_send_* are the
# verbs' own tests, below any library): shown beside ours when our bench ran over rdma. Each: (what, the
# message size our closest row has, or None, the figure, where it was published).
PUBLISHED_RDMA = (
    ("ib_send_lat, UC, 1 QP", 4 << 10, "4.64 us average, p99 5.96 us (64 B: 4.15 us)",
     "github.com/hellas-ai/thunderbolt-ibverbs PRs #27, #28"),
    ("ib_send_bw, UC, 64 KiB messages, 1 QP", None, "75 Gbit/s (9.4 GB/s)",
     "github.com/hellas-ai/thunderbolt-ibverbs PR #27"),
    ("PyTorch RDMA prototype, all_reduce", 1 << 20, "1 MiB 7.08 GB/s; 16 MiB 9.07 GB/s",
     "github.com/pytorch/pytorch PR #181087"),
    ("TCCL (c10d backend for mps), all_reduce", None, "~7.6 GB/s per rank (claimed)",
     "github.com/pytorch/pytorch PR #189856"),
    ("IP over the same Thunderbolt 5 cable, iperf3 4 streams", None, "52-64 Gbit/s, RTT 0.34-0.70 ms",
     "github.com/exo-explore/exo PR #2063"),
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


def _model() -> str:
    """Which computer: the Mac's model identifier (Mac16,9), elsewhere what the firmware says, if anything."""
    if sys.platform == "darwin":
        return _first_line(["sysctl", "-n", "hw.model"])
    try:
        with open("/sys/devices/virtual/dmi/id/product_name") as f:
            return f.read().strip()
    except OSError:
        return ""


def system_facts() -> dict[str, Any]:
    """Versions and hardware of this host (read only)."""
    import torch

    from ..version import __version__

    mac = platform.mac_ver()[0]
    return {"os": f"macOS {mac}" if mac else platform.platform(), "machine": platform.machine(), "model": _model(),
            "cpu": _cpu(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_thunderbolt": __version__}


def doctor_record(facts: "Facts", findings: "list[Finding]") -> dict[str, Any]:
    """What the report keeps of one host's doctor run: its findings, and the facts behind the open questions
    (interfaces and cables, RDMA's state). Never the environment (it may hold the job's secret)."""
    ports = facts.topology.get("ports", [])
    return {"findings": [dataclasses.asdict(f) for f in findings], "interfaces": facts.interfaces,
            "thunderbolt_ifnames": facts.thunderbolt_ifnames, "mtus": facts.mtus,
            # The link rate of each cabled Thunderbolt port (what the cable bound is taken from).
            "port_speeds": {p["ifname"]: p["speed_gbps"] for p in ports
                            if p.get("ifname") and p.get("status") == "connected" and p.get("speed_gbps")},
            "chosen_addresses": facts.chosen_addresses, "congestion_control": facts.congestion_control,
            "bridge_members": facts.bridge_members,
            "rdma": dataclasses.asdict(facts.rdma) if facts.rdma else None, "topology": facts.topology}


GUIDANCE = "docs/parallelism.md"  # which parallelism over which cable: the row a report points to
TB_TCP_MIN_GBPS = 20.0  # a Thunderbolt link below this is no faster than Ethernet for the guidance


def guidance(doctor: dict[str, dict], hosts: int) -> dict[str, str]:
    """The row of the guidance page that matches these hosts and cables, and why."""
    if hosts <= 1:
        return {"row": f"{GUIDANCE}#one-mac", "why": "every rank on one Mac: shared memory between them"}
    records = list(doctor.values())
    rdma = bool(records) and all((d.get("rdma") or {}).get("devices") and not (d.get("rdma") or {}).get("error")
                                 for d in records)
    if rdma:
        return {"row": f"{GUIDANCE}#thunderbolt-5-with-rdma", "why": "RDMA devices on every host"}
    slowest = [min(d["port_speeds"].values()) for d in records if d.get("port_speeds")]
    if records and len(slowest) == len(records) and min(slowest) >= TB_TCP_MIN_GBPS:
        return {"row": f"{GUIDANCE}#thunderbolt-over-tcp",
                "why": f"Thunderbolt cables at {min(slowest):g} Gb/s or more on every host, over TCP"}
    return {"row": f"{GUIDANCE}#ethernet-speeds",
            "why": "a host without a Thunderbolt cable, or one slower than "
                   f"{TB_TCP_MIN_GBPS:g} Gb/s: Ethernet speeds (1-10 Gbit/s)"}


def cables(doctor: dict[str, dict]) -> str:
    """Which cable joins which hosts' ports, at what speed, as `topo` sees them from every host's discovery."""
    from ..errors import ThunderboltError
    from ..topology.model import Host
    from ..topology.report import analyse, cluster_report

    dumps = {key: d["topology"] for key, d in doctor.items() if d.get("topology")}
    names = [t.get("name") for t in dumps.values()]
    try:
        # Two Macs may share a name ("MacBook-Pro"); the report's key for each ("name (rank r)") does not.
        hosts = [Host.from_json(t if names.count(t.get("name")) == 1 else {**t, "name": key})
                 for key, t in dumps.items()]
        if not hosts:
            return "no host could be discovered"
        text = cluster_report(analyse(hosts))
    except (ThunderboltError, ValueError, KeyError) as exc:
        return f"the hosts' discoveries do not make one cluster: {exc}"
    return text.split("\n\nAddress plan")[0]  # the plan and its commands are `topo`'s business


def _published_beside(ours: dict[int, dict]) -> list[str]:
    out = []
    for what, size, figure, source in PUBLISHED_RDMA:
        mine = ours.get(size) if size is not None else None
        beside = f" (ours at {format_size(size)}B: {mine['time_us']:.1f} us, {mine['busbw_gbps']:.2f} GB/s)" \
            if mine else ""
        out.append(f"{what}: {figure}{beside} [{source}]")
    return out


def bench_summary(records: list[dict], cable_rate: str | None, single_host: bool) -> str:
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
    if cable_rate is None and not single_host:
        out += "; no cable bound (cable rate unknown: pass --cable-rate)"
    if any("rdma" in str(r.get("transport")) for r in ours.values()):
        out += "; published over RDMA between two Macs: " + "; ".join(_published_beside(ours))
    return out


def document(sc: Findings, stuck: str | None) -> dict[str, Any]:
    tally = counts(sc.lines)
    return {
        "version": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "quick": sc.opts.quick,
        "world_size": sc.world,
        "seconds": round(time.monotonic() - sc.started, 2),
        "result": "FAIL" if stuck or tally["FAIL"] else "warn" if tally["warn"] else "ok",
        "counts": tally,
        "stopped": stuck,
        "reported_by": sc.rank,
        "hosts": [{k: h[k] for k in ("rank", "hostname", "os", "machine", "model", "cpu", "python", "torch",
                                     "torch_thunderbolt", "mps")} for h in sc.hosts],
        "doctor": sc.doctor,
        "cables": cables(sc.doctor) if sc.doctor else "",
        "guidance": guidance(sc.doctor, len({h["host"] for h in sc.hosts})),
        "checks": [line.to_json() for line in sc.lines],
        "ddp": sc.ddp_figures,
        "bench": {"records": sc.figures, "meta": sc.bench_meta, "text": sc.bench_text,
                  "published_rdma": [{"what": w, "figure": f, "source": src} for w, _, f, src in PUBLISHED_RDMA]},
    }


def _cell(text: str) -> str:
    """`text` inside one cell of a Markdown table."""
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict[str, Any]) -> str:
    out = [f"# torch-thunderbolt selfcheck: {doc['result']}", "",
           f"{doc['created']}, {doc['world_size']} ranks, {doc['seconds']} s{', quick' if doc['quick'] else ''}; "
           f"{summary(doc['counts'])}"
           + (f"; stopped: {doc['stopped']}" if doc["stopped"] else ""), "", "## Hosts", "",
           "| rank | host | os | model, chip | python | torch | torch-thunderbolt | mps |", "|---|---|---|---|---|---|---|---|"]
    out += [f"| {h['rank']} | {h['hostname']} | {h['os']} | {' '.join(filter(None, (h['model'], h['cpu'])))} | "
            f"{h['python']} | {h['torch']} | {h['torch_thunderbolt']} | {h['mps']} |" for h in doc["hosts"]]
    out += ["", "## Interfaces and cables", ""]
    for host, d in doc["doctor"].items():
        speeds = ", ".join(f"{k} {v:g} Gb/s" for k, v in d["port_speeds"].items()) or "none cabled"
        out.append(f"- {host}: Thunderbolt {', '.join(d['thunderbolt_ifnames']) or 'none'} ({speeds}); "
                   f"a job uses {', '.join(d['chosen_addresses']) or '?'}; "
                   + ", ".join(f"{k} {' '.join(v)}" + (f" (mtu {d['mtus'][k]})" if k in d["mtus"] else "")
                               for k, v in d["interfaces"].items()))
        rdma = d.get("rdma")
        if rdma:
            out.append(f"  - RDMA: rdma_ctl {rdma['rdma_ctl']!r}, provider {rdma['provider'] or '-'}, "
                       f"{len(rdma['devices'])} device(s){', error: ' + rdma['error'] if rdma['error'] else ''}"
                       f"{', the probe hung' if rdma['hung'] else ''}")
    if doc["cables"]:
        out += ["", "```", doc["cables"], "```"]
    if doc.get("guidance"):
        out += ["", f"Which parallelism over these cables: `{doc['guidance']['row']}` ({doc['guidance']['why']})."]
    out += ["", "## Checks", "", "| status | check | detail | fix |", "|---|---|---|---|"]
    out += ["| " + " | ".join(_cell(c[k]) for k in ("status", "check", "detail", "fix")) + " |" for c in doc["checks"]]
    errors = [(c["check"], e) for c in doc["checks"] for e in c["errors"]]
    if errors:
        out += ["", "## Errors in full", ""]
        for check, e in errors:
            out += [f"### {check}", "", "```", e, "```", ""]
    if doc["ddp"]:
        out += ["", "## DDP: the exchange behind the backward pass", "",
                "| device | over | parameters | backward alone (ms) | with the exchange (ms) | exchange alone (ms) "
                "| share hidden |", "|---|---|---|---|---|---|---|"]
        out += [f"| {d} | {f['transport']} | {f['parameters']} | {1e3 * f['compute_s']:.1f} | {1e3 * f['step_s']:.1f} | "
                f"{1e3 * f['exchange_s']:.1f} | {f['hidden']:.2f} |" for d, f in doc["ddp"].items()]
    if doc["bench"]["text"]:
        out += ["", "## Bench", "", "```", doc["bench"]["text"].rstrip(), "```"]
        if any("rdma" in str(r.get("transport")) for r in doc["bench"]["records"]):
            out += ["", "Published over RDMA between two Macs (not ours):", ""]
            out += [f"- {p['what']}: {p['figure']} ({p['source']})" for p in doc["bench"]["published_rdma"]]
    return "\n".join(out) + "\n"


def write(directory: str, doc: dict[str, Any], rank: int = 0) -> tuple[str, str]:
    """`selfcheck-<date>.md` and `.json` in `directory`; written by a rank other than 0 (rank 0 stuck), the
    names say which."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    base = os.path.join(directory, f"selfcheck-{stamp}" + (f"-rank{rank}" if rank else ""))
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
