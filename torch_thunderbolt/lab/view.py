"""The per-host view of a running lab, for the CLI, the launcher and tests.

    lab = Lab.load("tblab")
    lab.hosts()                  # ['mac0', 'mac1', 'mac2']
    lab.addresses("mac1")        # every cable address of mac1
    lab.ifname_env("mac1")       # 'tb0_0,tb2_0' (THUNDERBOLT_IFNAME / GLOO_SOCKET_IFNAME)
    lab.run("mac2", ["ping", "-c1", lab.addresses("mac0")[0]])
    lab.counters("mac1")         # {'tb0_0': (rx_bytes, tx_bytes), ...}
"""
from __future__ import annotations

import os
import subprocess
from typing import Any, Sequence

from ..errors import ConfigError
from .executor import Runner, qdisc_kinds, read_counters, subprocess_runner
from .blueprint import LabPlan
from .state import load_state



class Lab:
    def __init__(self, plan: LabPlan, runner: Runner = subprocess_runner) -> None:
        self.plan = plan
        self._runner = runner

    @classmethod
    def load(cls, name: str, directory: str | os.PathLike | None = None,
             runner: Runner = subprocess_runner) -> "Lab":
        return cls(load_state(name, directory), runner)

    @property
    def name(self) -> str:
        return self.plan.name

    def hosts(self) -> list[str]:
        return list(self.plan.hosts)

    def index(self, host: int | str) -> int:
        """Host by index (2 or '2'), name ('mac2') or namespace name."""
        text = str(host).strip()
        if text.isdigit() and int(text) < len(self.plan.hosts):
            return int(text)
        for i, (name, ns) in enumerate(zip(self.plan.hosts, self.plan.namespaces)):
            if text in (name, ns):
                return i
        raise ConfigError(f"lab {self.name!r} has no host {text!r}: expected an index "
                          f"0..{len(self.plan.hosts) - 1} or one of {', '.join(self.plan.hosts)}")

    def namespace(self, host: int | str) -> str:
        return self.plan.namespaces[self.index(host)]

    def ends(self, host: int | str) -> list[tuple[str, str, int]]:
        """(ifname, address, peer index) for each cable end of `host`, in cable order."""
        i = self.index(host)
        ends = []
        for c in self.plan.cables:
            if c.a == i:
                ends.append((c.ifname_a, c.addr_a, c.b))
            elif c.b == i:
                ends.append((c.ifname_b, c.addr_b, c.a))
        return ends

    def addresses(self, host: int | str) -> list[str]:
        return [addr for _, addr, _ in self.ends(host)]

    def ifnames(self, host: int | str) -> list[str]:
        return [dev for dev, _, _ in self.ends(host)]

    def ifname_env(self, host: int | str) -> str:
        return ",".join(self.ifnames(host))

    def neighbours(self, host: int | str) -> list[str]:
        return sorted({self.plan.hosts[peer] for _, _, peer in self.ends(host)},
                      key=self.plan.hosts.index)

    def exec_argv(self, host: int | str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def run(self, host: int | str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run inside the host's namespace (kwargs go to subprocess.run)."""
        kwargs.setdefault("check", False)
        return subprocess.run(self.exec_argv(host, argv), **kwargs)

    def counters(self, host: int | str) -> dict[str, tuple[int, int]]:
        """{ifname: (rx_bytes, tx_bytes)} for the host's cable interfaces."""
        return read_counters(self.namespace(host), self.ifnames(host), self._runner)

    def qdiscs(self, host: int | str) -> dict[str, list[str]]:
        return {dev: qdisc_kinds(self.namespace(host), dev, self._runner) for dev in self.ifnames(host)}

    def hostfile(self) -> list[dict]:
        """Hosts in the launcher's hostfile format, reached through this lab instead of ssh."""
        return [{"name": name, "exec": "lab", "lab": self.name, "namespace": self.namespace(i),
                 "addresses": self.addresses(i),
                 "ifname": self.ifname_env(i)} for i, name in enumerate(self.plan.hosts)]


def status_rows(plan: LabPlan, counters: dict[str, dict[str, tuple[int, int]]] | None = None) -> list[dict]:
    """One row per cable end (pure; `counters` is {host: {ifname: (rx, tx)}} when known)."""
    lab = Lab(plan)
    rows = []
    for name in plan.hosts:
        for dev, addr, peer in lab.ends(name):
            rx, tx = (counters or {}).get(name, {}).get(dev, (None, None))
            rows.append({"host": name, "namespace": lab.namespace(name), "ifname": dev, "address": addr,
                         "peer": plan.hosts[peer], "rate": plan.rate or "unshaped", "rx_bytes": rx,
                         "tx_bytes": tx})
    return rows


def format_status(plan: LabPlan, rows: list[dict]) -> str:
    forwarders = ", ".join(plan.hosts[i] for i in plan.forwarders) or "none"
    lines = [f"lab {plan.name}: {len(plan.hosts)} hosts, {plan.topology}, {len(plan.cables)} cables, "
             f"rate {plan.rate or 'unshaped'}, mtu {plan.mtu or 'default'}, cc {plan.cc or 'default'}, "
             f"forwarding on {forwarders}",
             f"{'host':<6} {'namespace':<20} {'ifname':<8} {'address':<15} {'peer':<6} "
             f"{'rx_bytes':>14} {'tx_bytes':>14}"]
    for r in rows:
        rx = "-" if r["rx_bytes"] is None else str(r["rx_bytes"])
        tx = "-" if r["tx_bytes"] is None else str(r["tx_bytes"])
        lines.append(f"{r['host']:<6} {r['namespace']:<20} {r['ifname']:<8} {r['address']:<15} "
                     f"{r['peer']:<6} {rx:>14} {tx:>14}")
    return "\n".join(lines)
