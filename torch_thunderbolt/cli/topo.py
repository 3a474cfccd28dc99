"""`torch-thunderbolt topo`: Thunderbolt discovery, bridge-loop check, address plan, hostfile, graph."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from ..errors import ConfigError, ThunderboltError
from ..topology.discover import RunCommand, discover_local, local_hostname, subprocess_runner
from ..topology.draw import require_png, to_dot, write_png
from ..topology.model import Host, load_host_dump
from ..topology.record import RECORD_FILE, record
from ..topology.addressing import DEFAULT_BASE
from ..topology import persist
from ..topology.remote import apply_commands, gather_over_ssh, parse_ssh_list
from ..topology.report import analyse, analysis_json, cluster_report, commands_text, host_summary, hostfile


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dump", metavar="FILE", help="write this host's discovery as JSON ('-' = stdout)")
    parser.add_argument("--record", metavar="DIR",
                        help="save this host's raw system_profiler/networksetup/ifconfig (Linux: sysfs, ip) "
                             "outputs in DIR/HOSTNAME as a test fixture, for a bug report")
    parser.add_argument("--from", dest="from_files", nargs="+", metavar="DUMP",
                        help="build the cluster graph from these hosts' --dump files")
    parser.add_argument("--ssh", metavar="HOST,HOST", help="gather dumps over ssh (runs `topo --dump -` there)")
    parser.add_argument("--python", metavar="PATH", default=sys.executable,
                        help="Python with torch-thunderbolt on the --ssh hosts, by absolute path (default: "
                             "this one's; a Mac's ssh PATH only finds Apple's python3 3.9)")
    parser.add_argument("--base", default=DEFAULT_BASE, help=f"network to carve /30s from (default {DEFAULT_BASE})")
    parser.add_argument("--mtu", type=int, help="also set this MTU on every cabled port (e.g. 9000)")
    parser.add_argument("--hostfile", metavar="OUT", help="write the launcher hostfile (JSON)")
    parser.add_argument("--dot", metavar="OUT", help="write the graph as Graphviz DOT ('-' = stdout)")
    parser.add_argument("--png", metavar="OUT", help="draw the graph as PNG (needs matplotlib)")
    parser.add_argument("--apply", action="store_true",
                        help="run the plan's commands (this host locally, --ssh hosts over ssh; sudo)")
    parser.add_argument("--persist", action="store_true",
                        help="on this Mac, as root: install a LaunchDaemon that keeps the Thunderbolt ports out of "
                             "the bridge after every reboot (`ifconfig bridgeN deletem` does not survive one)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, *, runner: RunCommand = subprocess_runner, system: str | None = None,
        hostname: str | None = None, sysfs_root: str = "/", root: str = "/") -> int:
    def local() -> Host:
        return discover_local(runner, system=system, hostname=hostname, sysfs_root=sysfs_root)

    if args.png:  # before anything is written, gathered or applied (as bench checks --plot)
        require_png()
    cluster = bool(args.from_files or args.ssh)
    if args.persist:
        if cluster or args.record or args.dump or args.hostfile or args.dot or args.png or args.apply:
            raise ConfigError("--persist installs on this Mac alone: run it by itself on each Mac (after "
                              "--apply, topo prints the command for every Mac)")
        return _persist(local(), runner, Path(root))
    if args.record:
        if cluster or args.dump:
            raise ConfigError("--record saves this host's outputs; it does not combine with --dump/--from/--ssh")
        return _record(args.record, runner, system, hostname or local_hostname(), sysfs_root)
    if args.dump:
        if cluster:
            raise ConfigError("--dump writes this host's discovery; it does not combine with --from/--ssh")
        _write(args.dump, json.dumps(local().to_json(), indent=2) + "\n")
        return 0
    if not cluster:
        if args.hostfile or args.dot or args.png or args.apply:
            raise ConfigError("--hostfile/--dot/--png/--apply need the cluster: give --from DUMP... or --ssh HOSTS")
        host = local()
        print(json.dumps(host.to_json(), indent=2) if args.json else host_summary(host))
        return 0
    return _cluster(args, runner, local, hostname or local_hostname())


def _cluster(args, runner: RunCommand, local, local_name: str) -> int:
    hosts = [load_host_dump(_read(path), path) for path in args.from_files or []]
    hosts += gather_over_ssh(parse_ssh_list(args.ssh), runner, args.python) if args.ssh else []
    if args.apply:  # plan against this host's state now, not a possibly stale dump
        hosts = [local() if h.name == local_name and not h.ssh else h for h in hosts]
    a = analyse(hosts, base=args.base, mtu=args.mtu)
    if args.hostfile:
        _write(args.hostfile, json.dumps(hostfile(a, args.python), indent=2) + "\n")
    if args.dot:
        _write(args.dot, to_dot(a.graph, a.plan, a.loops))
    if args.png:
        write_png(args.png, a.graph, a.plan, a.loops, order=a.order[1] if a.order else None,
                  title=f"Thunderbolt {a.shape}: {len(a.graph.hosts)} hosts, {len(a.graph.cables)} cables")
    out = sys.stderr if args.dot == "-" else sys.stdout
    print(json.dumps(analysis_json(a), indent=2) if args.json else cluster_report(a), file=out)
    if not args.apply:
        return 1 if a.loops else 0
    ssh = {h.name: h.ssh for h in a.graph.hosts if h.ssh}
    done = apply_commands(a.commands, runner, local_name, ssh, is_root=_is_root(),
                          log=lambda line: print(f"running: {line}", file=sys.stderr))
    print(f"Applied {len(done.ran)} commands, {len(done.skipped)} already satisfied.", file=sys.stderr)
    keep = [persist.persist_command(args.python, h.ssh) for h in a.graph.hosts if h.platform == "macos" and h.bridge]
    if keep:
        print("Taking the ports out of the bridge does not survive a reboot; to keep it, run on each Mac once "
              "(it installs a LaunchDaemon):\n  " + "\n  ".join(keep), file=sys.stderr)
    if done.unreachable:
        print("Not reachable from here (run these on those hosts yourself, or use --ssh):\n"
              + commands_text(done.unreachable), file=sys.stderr)
        return 1
    return 0


def _persist(host: Host, runner: RunCommand, root: Path) -> int:
    bridge, ports = persist.ports_to_keep_out(host)
    plist = persist.daemon_plist(bridge, ports)
    if not _is_root():
        raise ConfigError(f"--persist writes {persist.plist_path(root)} and loads it with launchctl, as root: "
                          f"{persist.persist_command()}")
    path = persist.install(plist, root)
    unload, load = persist.load_commands(path)
    runner(unload)  # fails when no earlier copy is loaded: nothing to undo then
    done = runner(load)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or "no output"
        raise ThunderboltError(f"wrote {path}, but `{shlex.join(load)}` failed (exit {done.returncode}): {said}")
    print(f"Installed {path}: at every boot and every {persist.RECHECK_SECONDS} s it runs, as root, "
          f"`{persist.boot_script(bridge, ports)}`.\nTo undo: {persist.undo_text(path)}")
    return 0


def _record(directory: str, runner: RunCommand, system: str | None, hostname: str, sysfs_root: str) -> int:
    folder = record(directory, runner, system=system, hostname=hostname, sysfs_root=sysfs_root)
    meta = json.loads((folder / RECORD_FILE).read_text())
    failed = [c for c in meta["commands"] if c["exit"] != 0]
    print(f"Recorded {hostname}'s discovery outputs in {folder}/ ({', '.join(sorted(p.name for p in folder.iterdir()))}).")
    for c in failed:
        print(f"  `{' '.join(c['argv'])}` failed (exit {c['exit']}): {c['stderr'] or 'no output'}")
    parsed = meta["parsed"]
    print("  topo reads them: " + (f"{len(parsed['host']['ports'])} Thunderbolt port(s)" if parsed["ok"]
                                   else f"NO: {parsed['error']}"))
    print(f"They hold this machine's interface names and its MAC and IP addresses: look them over, then attach "
          f"the folder to the bug report (tar czf {hostname}.tgz -C {directory} {hostname}).")
    return 0


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _read(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read dump {path}: {exc.strerror}") from None


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
