"""`doctor`: is this machine ready for torch-thunderbolt? Pure checks over gathered facts.

`gather_facts()` is the only I/O; `run_checks(facts)` turns facts into findings with a fix for each
problem, so every check is unit-testable with made-up facts.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import platform
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from .config import ADVANCED, SETTING_NAMES, SETTINGS, USER, Config
from .errors import ConfigError
from .macos_firewall import (FIREWALL_BLOCK_ALL, FIREWALL_OFF, FirewallFacts, allow_commands, listed_verdict,
                             listening_binary, parse_app_blocked, parse_global_state, parse_listed_apps,
                             read_firewall, this_interpreter)
from .platform import LOCAL_NETWORK_SETTING, PMSET, RDMA_CTL, SYSCTL, Platform, current, macos_version

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Finding:
    status: str
    check: str
    detail: str
    fix: str = ""


@dataclass
class Facts:
    system: str
    python: str
    torch: str | None
    backend_registered: bool
    env: dict[str, str]
    interfaces: dict[str, list[str]]  # name -> IPv4 addresses
    thunderbolt_ifnames: list[str]  # interfaces that carry IP over Thunderbolt
    mtus: dict[str, int] = field(default_factory=dict)
    congestion_control: str = ""
    max_socket_buffer: int = 0  # bytes a socket may ask for (rmem_max / kern.ipc.maxsockbuf), 0 = unknown
    bridge_members: list[str] = field(default_factory=list)  # Thunderbolt ports in bridge0
    effective_socket_buffer: int = 0  # what a stream's SO_RCVBUF ends up as here (after ENOBUFS retries), 0 = unknown
    local_network_privacy: bool = False  # macOS 15+: connections to attached subnets need the app's permission
    # "address:port" -> errno of a probe connection (0: reached, or refused by the host: the permission is fine)
    local_network_probes: dict[str, int] = field(default_factory=dict)
    # What a job's TCP set-up would choose here (transport.netif.choose_addresses, the job's own function,
    # given THUNDERBOLT_IFNAME and MASTER_ADDR): the addresses, or the error it would raise.
    store_host: str = ""  # MASTER_ADDR, which a job without THUNDERBOLT_IFNAME routes towards
    chosen_addresses: list[str] = field(default_factory=list)
    choice_error: str = ""
    # THUNDERBOLT_CC tried on a socket here (rendezvous.tcp.congestion_control_problem): why a job would
    # refuse it, "" when it would not.
    cc_error: str = ""
    # A connection to MASTER_ADDR:MASTER_PORT: "accepted", "refused" or the error's name ("" = not probed).
    store_probe: str = ""
    rdma: "RdmaFacts | None" = None  # gathered on a Mac, or where a job would use RDMA (forced, a fake fabric)
    topology: dict[str, Any] = field(default_factory=dict)  # `topo --dump` of this host; {} if discovery failed
    firewall: FirewallFacts | None = None  # macOS: what socketfilterfw says about the binary that listens
    pmset: "tuple[str, str] | None" = None  # a Mac's `pmset -g batt` and `pmset -g` output (_check_sleep)


@dataclass
class RdmaFacts:
    """What RDMA over Thunderbolt needs, as found here."""

    macos: str = ""  # the macOS version ("26.3"); "" elsewhere
    rdma_ctl: str | None = None  # what `rdma_ctl status` printed; None when it did not run
    provider: str = ""  # the verbs library (or fake fabric) the probe loaded
    error: str = ""  # why the probe found no library or no device list
    hung: bool = False  # the probe did not return (a wedged port hangs every verbs call)
    devices: list[dict[str, Any]] = field(default_factory=list)  # transport.rdma.DeviceState fields
    port_speeds: dict[str, float] = field(default_factory=dict)  # Thunderbolt interface -> link Gb/s


# What this version was tested on (also in the README's "Tested versions"). Nothing has run on a Mac.
TESTED_TORCH = "2.13.0"
TESTED_ON = "torch 2.13.0 (CPU build), Python 3.11, Linux x86_64"


def run_checks(f: Facts) -> list[Finding]:
    out: list[Finding] = []
    out.append(_check_torch(f))
    out.append(_check_tested(f))
    # Every bad setting, each with its fix, in one run; the later checks see the others (bad ones at their
    # defaults), as far as they can tell anything.
    cfg, problems = Config.parse_env(f.env)
    settings = _check_settings(f.env)
    if not problems or settings.status != OK:
        out.append(settings)
    out.extend(Finding(FAIL, "configuration", str(p), _setting_fix(p)) for p in problems)
    out.append(_check_interfaces(f, cfg))
    out.append(_check_choice(f, cfg))
    if f.store_probe:
        out.append(_check_store(f))
    out.extend(_check_links(f))
    out.append(_check_buffers(f, cfg))
    if cfg.shm_dir and f.system == "Darwin":
        out.append(_check_shm_dir_on_a_mac(cfg.shm_dir))
    if f.local_network_privacy:
        out.append(_check_local_network(f))
    if f.pmset is not None:
        out.append(_check_sleep(f.pmset, cfg))
    if f.rdma is not None:
        out.extend(check_rdma(f.rdma, cfg))
    if f.firewall is not None:
        out.append(check_firewall(f.firewall))
    if f.cc_error:
        out.append(Finding(FAIL, "THUNDERBOLT_CC", f.cc_error, "unset THUNDERBOLT_CC, or name a congestion "
                           "control this kernel has"))
    if f.congestion_control:
        status = OK if f.congestion_control in ("cubic", "reno") else WARN
        out.append(Finding(status, "TCP congestion control", f.congestion_control,
                           "" if status == OK else "bbr caps one stream well below the link on fast links; "
                           "try THUNDERBOLT_CC=cubic, and compare backends under the same setting"))
    return out


def _check_shm_dir_on_a_mac(shm_dir: str) -> Finding:
    """On macOS CPython's mmap asks for F_FULLFSYNC on every file it maps (mmapmodule.c): each shared-memory
    segment set up in THUNDERBOLT_SHM_DIR flushes the whole disk's cache first."""
    return Finding(WARN, "THUNDERBOLT_SHM_DIR", f"{shm_dir}: on macOS every segment mapped there flushes the disk's "
                   "cache first (Python's mmap asks for F_FULLFSYNC), at each group's set-up",
                   "unset THUNDERBOLT_SHM_DIR: POSIX shared memory is the default on a Mac")


def _check_torch(f: Facts) -> Finding:
    if f.torch is None:
        return Finding(FAIL, "torch", "not installed", "pip install torch")
    if not f.backend_registered:
        return Finding(FAIL, "backend", f"torch {f.torch}: 'thunderbolt' is not registered",
                       "import torch_thunderbolt before init_process_group")
    return Finding(OK, "torch", f"torch {f.torch}, backend 'thunderbolt' registered")


def _check_tested(f: Facts) -> Finding:
    """Say plainly what this version was tested on, and that a Mac is not among it."""
    detail = f"tested on {TESTED_ON} only; never run on a Mac (its behaviour is emulated in the tests)"
    if f.system == "Darwin":
        return Finding(WARN, "tested versions", f"this is a Mac: {detail}",
                       "please report what works and what does not, with `torch-thunderbolt topo --record DIR` "
                       "attached (see the README)")
    if f.torch and f.torch.split("+")[0] != TESTED_TORCH:
        return Finding(WARN, "tested versions", f"torch {f.torch} here; {detail}", "")
    return Finding(OK, "tested versions", detail)


def _check_settings(env: dict[str, str]) -> Finding:
    """The THUNDERBOLT_* variables set, by audience as config.SETTINGS (and docs/configuration.md) class
    them; names only, never values (one may be the secret). A name that is no setting is ignored by every
    job, so a misspelt one would otherwise go unnoticed."""
    named = sorted(k for k in env if k.startswith("THUNDERBOLT_"))
    unknown = [k for k in named if k not in SETTING_NAMES]
    if unknown:
        return Finding(WARN, "configuration", f"{', '.join(unknown)}: no setting of this version, so ignored",
                       "correct the name or unset it; docs/configuration.md lists every setting")
    by = {aud: [s.name for s in SETTINGS if s.audience == aud and s.name in env] for aud in (USER, ADVANCED)}
    if not named:
        return Finding(OK, "configuration", "no THUNDERBOLT_* variable set: the defaults")
    parts = [f"{aud}: {', '.join(names)}" for aud, names in by.items() if names]
    return Finding(OK, "configuration", f"THUNDERBOLT_* variables parse; set ({'; '.join(parts)})")


def _setting_fix(problem: ConfigError) -> str:
    """What to do about one bad setting: its message says what was expected; which variable to change."""
    name = str(problem).split(":", 1)[0].split("=", 1)[0].strip()
    if name in SETTING_NAMES:
        return f"fix {name} as the message says, or unset it (docs/configuration.md: its values and default)"
    return "fix or unset the variable it names (docs/configuration.md lists every setting)"


def _check_choice(f: Facts, cfg: Config) -> Finding:
    """Which addresses (interfaces) a job's ranks would listen on and connect from, and why."""
    check = "addresses a job uses"
    if f.choice_error:
        return Finding(FAIL, check, f.choice_error, "fix THUNDERBOLT_IFNAME or MASTER_ADDR")
    owner = {a: n for n, addrs in f.interfaces.items() for a in addrs}
    chosen = ", ".join(f"{a} ({owner.get(a, 'loopback' if a.startswith('127.') else '?')})"
                       for a in f.chosen_addresses)
    if cfg.ifnames:
        why = f"named by THUNDERBOLT_IFNAME={','.join(cfg.ifnames)}"
    elif f.store_host:
        why = (f"THUNDERBOLT_IFNAME is unset, so the interface this machine reaches MASTER_ADDR={f.store_host} "
               f"through")
    else:
        why = ("neither THUNDERBOLT_IFNAME nor MASTER_ADDR is set, so loopback: ranks on this machine only "
               "(run doctor with MASTER_ADDR=<rank 0's Thunderbolt address> to see a multi-Mac job's choice)")
    ports = ("any free port" if not cfg.port else f"port {cfg.port} (THUNDERBOLT_PORT + LOCAL_RANK)"
             if cfg.port_range[0] == cfg.port_range[1] else
             f"a free port in {cfg.port_range[0]}-{cfg.port_range[1]}, from {cfg.port} on")
    where = "0.0.0.0 (THUNDERBOLT_LISTEN_ALL=1)" if cfg.listen_all else "these addresses"
    detail = f"{chosen}: {why}; ranks listen on {where}, {ports}"
    off_cable = [owner.get(a, "?") for a in f.chosen_addresses
                 if not a.startswith("127.") and owner.get(a) not in f.thunderbolt_ifnames]
    if off_cable and not cfg.ifnames:
        suggestion = ",".join(n for n in f.thunderbolt_ifnames if f.interfaces.get(n))
        return Finding(WARN, check, f"{detail}; {', '.join(off_cable)} is not a Thunderbolt interface",
                       "put MASTER_ADDR on rank 0's Thunderbolt address" +
                       (f", or set THUNDERBOLT_IFNAME={suggestion}" if suggestion else ""))
    return Finding(OK, check, detail)


def _check_store(f: Facts) -> Finding:
    """What a connection to MASTER_ADDR:MASTER_PORT ran into (the job's first connection)."""
    target = f"{f.env.get('MASTER_ADDR', '').strip()}:{f.env.get('MASTER_PORT', '').strip()}"
    check = "rendezvous store"
    if f.store_probe == "accepted":
        return Finding(OK, check, f"{target} accepts connections (rank 0's store, if a job is starting; "
                       "otherwise another program holds MASTER_PORT: choose a free one)")
    if f.store_probe == "refused":
        return Finding(OK, check, f"{target}: the host answers, nothing listens on the port yet (fine while "
                       "rank 0 is not running)")
    if f.store_probe == "ETIMEDOUT":
        return Finding(WARN, check, f"{target}: no answer", "a firewall on rank 0's Mac drops the connection "
                       "(there, `torch-thunderbolt doctor --firewall-command` prints how to allow its Python), or "
                       "no host has that address")
    return Finding(FAIL, check, f"{target}: {f.store_probe}", "MASTER_ADDR must be rank 0's address on a network "
                   "this machine is on (with one subnet per cable, the address of a cable joining the two); on "
                   f"macOS, EHOSTUNREACH/EPERM also mean a missing Local Network permission ({LOCAL_NETWORK_SETTING})")


def _check_interfaces(f: Facts, cfg: Config) -> Finding:
    if cfg.ifnames:
        missing = [n for n in cfg.ifnames if n not in f.interfaces and not _is_address(n, f)]
        if missing:
            return Finding(FAIL, "THUNDERBOLT_IFNAME", f"not found here: {', '.join(missing)}",
                           f"available: {', '.join(sorted(f.interfaces)) or 'none'}")
        return Finding(OK, "THUNDERBOLT_IFNAME", ", ".join(cfg.ifnames))
    if f.thunderbolt_ifnames:
        with_ip = [n for n in f.thunderbolt_ifnames if f.interfaces.get(n)]
        return Finding(WARN, "interface choice", "THUNDERBOLT_IFNAME is unset: the interface towards "
                       "MASTER_ADDR is used", f"set THUNDERBOLT_IFNAME={','.join(with_ip or f.thunderbolt_ifnames)} "
                       "so Wi-Fi or Ethernet is never used by accident")
    return Finding(WARN, "interfaces", "no Thunderbolt network interface found (fine for local ranks)",
                   "cable the Macs and run `torch-thunderbolt topo`")


def _is_address(text: str, f: Facts) -> bool:
    return any(text in addrs for addrs in f.interfaces.values())


def _check_links(f: Facts) -> list[Finding]:
    out = []
    for name in f.thunderbolt_ifnames:
        if not f.interfaces.get(name):
            out.append(Finding(WARN, f"{name}", "Thunderbolt interface without an IPv4 address",
                               "`torch-thunderbolt topo --apply` gives each cable its own /30"))
        mtu = f.mtus.get(name, 0)
        if mtu and mtu < 9000:
            out.append(Finding(WARN, f"{name} MTU", f"{mtu}", "jumbo frames help TCP over Thunderbolt: "
                               f"sudo networksetup -setMTU {name} 9000 (or topo --mtu 9000)"))
    if len(f.bridge_members) >= 2:
        out.append(_check_bridge(f.bridge_members))
    return out


def _check_bridge(members: list[str]) -> Finding:
    from .topology.persist import bridge_back

    return Finding(WARN, "Thunderbolt Bridge", f"bridge0 holds {', '.join(members)}",
                   bridge_back("bridge0", members))


def _check_buffers(f: Facts, cfg: Config) -> Finding:
    if f.effective_socket_buffer and f.effective_socket_buffer < cfg.socket_buffer:
        return Finding(WARN, "socket buffers", f"THUNDERBOLT_SOCKET_BUFFER={cfg.socket_buffer}, but a stream "
                       f"gets {f.effective_socket_buffer} bytes here (the system's limit)",
                       "raise net.core.rmem_max/wmem_max (Linux) or kern.ipc.maxsockbuf (macOS), or lower "
                       "THUNDERBOLT_SOCKET_BUFFER")
    if f.effective_socket_buffer:
        return Finding(OK, "socket buffers", f"{f.effective_socket_buffer} bytes per stream, as asked")
    if not f.max_socket_buffer:
        return Finding(OK, "socket buffers", "limit unknown")
    if f.max_socket_buffer < cfg.socket_buffer:
        return Finding(WARN, "socket buffers", f"the system caps buffers at {f.max_socket_buffer} bytes, "
                       f"below THUNDERBOLT_SOCKET_BUFFER={cfg.socket_buffer}",
                       "raise net.core.rmem_max/wmem_max (Linux) or kern.ipc.maxsockbuf (macOS)")
    return Finding(OK, "socket buffers", f"up to {f.max_socket_buffer} bytes allowed")


RECOVERY = ("start the Mac in Recovery (hold the power button), open Terminal from Utilities, run "
            "`rdma_ctl enable` and restart; it cannot be done remotely or from the running system")


def check_rdma(r: RdmaFacts, cfg: Config) -> list[Finding]:
    """RDMA over Thunderbolt 5: macOS version, `rdma_ctl status`, the verbs library, each device's port and
    GID, as a job's set-up would find them (transport/rdma.probe_device). A problem fails the check where
    THUNDERBOLT_TRANSPORT=rdma forces RDMA; otherwise jobs fall back to TCP and it is a warning."""
    bad = FAIL if cfg.transport == "rdma" else WARN
    out = []
    if r.macos:
        version = macos_version(r.macos)
        if version is None or version < (26, 2):
            out.append(Finding(bad, "RDMA: macOS", f"macOS {r.macos}: RDMA over Thunderbolt needs 26.2 or later",
                               "update macOS (jobs use TCP until then)"))
        elif version < (26, 3):
            out.append(Finding(WARN, "RDMA: macOS", f"macOS {r.macos} takes 4 KiB receives only: large messages "
                               "move in 4 KiB frames", "update to macOS 26.3 or later (64 KiB frames)"))
        else:
            out.append(Finding(OK, "RDMA: macOS", f"macOS {r.macos}"))
        if r.rdma_ctl is None:
            out.append(Finding(bad, "RDMA: rdma_ctl", f"`{RDMA_CTL} status` did not run", "macOS 26.2+ has it"))
        else:
            from .topology.macos import parse_rdma_ctl

            enabled = parse_rdma_ctl(r.rdma_ctl)
            if enabled:
                out.append(Finding(OK, "RDMA: rdma_ctl", "enabled"))
            else:
                said = r.rdma_ctl.strip() or "nothing"
                out.append(Finding(bad, "RDMA: rdma_ctl", f"RDMA is not enabled (`rdma_ctl status`: {said})",
                                   RECOVERY))
    if r.hung:
        out.append(Finding(FAIL, "RDMA: devices", "the verbs probe did not return: a port wedged after a failed "
                           "set-up hangs every verbs call (`ibv_devinfo` too)", "restart this Mac"))
        return out
    if r.error:
        out.append(Finding(bad, "RDMA: library", r.error, "" if r.provider else
                           "RDMA over Thunderbolt needs macOS 26.2+ (librdma.dylib)"))
        return out
    out.append(Finding(OK, "RDMA: library", r.provider))
    if not r.devices:
        out.append(Finding(bad, "RDMA: devices", "none listed", "RDMA needs Thunderbolt 5 at both ends and "
                           "`rdma_ctl enable`; a device rdma_enX appears for each Thunderbolt interface enX"))
    usable = []
    for d in r.devices:
        name, ifname = d["name"], d["name"].removeprefix("rdma_")
        speed = r.port_speeds.get(ifname, 0.0)
        if 0 < speed <= 40:
            out.append(Finding(WARN, f"RDMA: {name}", f"on a {speed:g} Gb/s port: Thunderbolt 4 or slower, where "
                               "the device appears but does not work", "RDMA needs Thunderbolt 5 ports and a "
                               "Thunderbolt 5 cable at both ends"))
        elif d.get("problem"):
            what, _, fix = d["problem"].partition(": ")
            out.append(Finding(bad, f"RDMA: {name}", what if fix else d["problem"], fix))
        else:
            usable.append(name)
            kib = int(d.get("frame_limit", 4096)) >> 10
            out.append(Finding(OK, f"RDMA: {name}", f"port {d.get('port')}, GID ::ffff:{d.get('ipv4')} (index "
                               f"{d.get('gid_index')}), receives up to {kib} KiB"))
    if usable and cfg.transport == "tcp":
        out.append(Finding(WARN, "RDMA: transport", f"THUNDERBOLT_TRANSPORT=tcp, though {', '.join(usable)} "
                           "work here", "unset it (auto uses RDMA between Macs where both ends have it)"))
    return out


def rdma_probe(env: "dict[str, str] | None" = None) -> dict[str, Any]:
    """What a job's set-up finds about RDMA here (the library, every device probed), as JSON-able data."""
    from .errors import RdmaError
    from .transport.providers import verbs_from_config
    from .transport.rdma import probe_devices

    try:
        verbs = verbs_from_config(Config.parse_env(env)[0])  # (a bad setting: the configuration check)
    except (RdmaError, ConfigError) as exc:
        return {"provider": "", "error": str(exc), "devices": []}
    try:
        return {"provider": verbs.provider.name, "error": "",
                "devices": [dataclasses.asdict(s) for s in probe_devices(verbs)]}
    except RdmaError as exc:
        return {"provider": verbs.provider.name, "error": str(exc), "devices": []}
    finally:
        verbs.close()


PROBE_SECONDS = 20.0  # a wedged port hangs verbs calls: the probe runs in a child process with this timeout


def gather_rdma(run: Callable[..., Any], plat: Platform, env: dict[str, str],
                port_speeds: dict[str, float]) -> RdmaFacts:
    """The RDMA facts: on a Mac `sw_vers` and `rdma_ctl status`, and everywhere the probe, in a child
    process (`python -c ... rdma_probe`) that `run` may time out."""
    facts = RdmaFacts(port_speeds=dict(port_speeds))
    if plat.name == "darwin":
        facts.macos = platform.mac_ver()[0]
        res = run([RDMA_CTL, "status"])
        facts.rdma_ctl = res.stdout if res.returncode == 0 else None
    res = run([sys.executable, "-c", "import json; from torch_thunderbolt.doctor import rdma_probe; "
               "print(json.dumps(rdma_probe()))"], timeout=PROBE_SECONDS)
    if res.returncode == 124:  # the runner's timeout
        facts.hung = True
        return facts
    try:
        found = json.loads(res.stdout.strip().splitlines()[-1])
        if not isinstance(found, dict) or not {"provider", "error", "devices"} <= found.keys():
            raise ValueError(f"unexpected probe output {found!r}")
    except (ValueError, IndexError) as exc:
        said = (res.stderr or "").strip()[-300:] or str(exc)
        facts.error = f"the verbs probe failed (exit {res.returncode}): {said}"
        return facts
    facts.provider, facts.error, facts.devices = found["provider"], found["error"], found["devices"]
    return facts


def check_firewall(fw: FirewallFacts) -> Finding:
    """Whether the macOS firewall lets this Python accept the other Macs' connections (every rank listens,
    rank 0's rendezvous store first of all)."""
    check, binary = "firewall", fw.binary
    allow = "run `torch-thunderbolt doctor --firewall-command` and the two commands it prints: " + "; ".join(
        allow_commands(binary))
    state = parse_global_state(fw.global_state)
    if state is None:
        said = fw.global_state.strip() or "nothing"
        return Finding(WARN, check, f"could not read the firewall's state (`socketfilterfw --getglobalstate`: "
                       f"{said})", f"if the firewall is on (System Settings › Network › Firewall), {allow}")
    if state == FIREWALL_OFF:
        return Finding(OK, check, "off: other Macs may connect to this one")
    if state == FIREWALL_BLOCK_ALL:
        return Finding(FAIL, check, "on and blocking all incoming connections: no other Mac can connect to a "
                       "rank here", "System Settings › Network › Firewall › Options: turn off \"Block all "
                       f"incoming connections\", then {allow}")
    listed = listed_verdict(parse_listed_apps(fw.listed), binary)
    blocked = parse_app_blocked(fw.app_blocked)
    if listed is False or blocked is True:
        return Finding(FAIL, check, f"on and blocking {binary}, the binary this Python runs as: other Macs "
                       "cannot connect to a rank here (rank 0's store is reported unanswered)", allow)
    if listed is None:
        return Finding(WARN, check, f"on, and {binary} (the binary this Python runs as) is not in its list: a "
                       "rank started over ssh cannot answer the firewall's prompt, so other Macs' connections "
                       "may stay blocked", allow)
    return Finding(OK, check, f"on; {binary} may accept incoming connections")


def gather_firewall(run: Callable[..., Any], plat: Platform) -> FirewallFacts | None:
    """The firewall's answers on a Mac (None elsewhere: no application firewall to ask)."""
    if plat.name != "darwin":
        return None
    return read_firewall(run, listening_binary(this_interpreter()))


LOCAL_NETWORK_DENIED = (errno.EPERM, errno.EHOSTUNREACH)


def _check_sleep(pmset: tuple[str, str], cfg: Config) -> Finding:
    """Whether this Mac may sleep during a job (on battery, lid, idle timer), and what that means."""
    from .backend.keep_awake import parse_power, power_advice

    fine, detail, fix = power_advice(parse_power(*pmset), cfg.keep_awake)
    return Finding(OK if fine else WARN, "sleep", detail, fix)


def _check_local_network(f: Facts) -> Finding:
    check = "Local Network permission"
    how = (f"allow the app this python runs under (Terminal, iTerm, VS Code, ...) in {LOCAL_NETWORK_SETTING} "
           "and restart it; ssh sessions are not affected")
    if not f.local_network_probes:
        return Finding(WARN, check, "not checked: macOS 15+ blocks connections to Thunderbolt peers from apps "
                       "without this permission (EHOSTUNREACH)", "run doctor with MASTER_ADDR=<a peer's "
                       f"Thunderbolt address> to probe it, or {how}")
    denied = {a: e for a, e in f.local_network_probes.items() if e in LOCAL_NETWORK_DENIED}
    if denied:
        what = ", ".join(f"{a} ({errno.errorcode.get(e, e)})" for a, e in sorted(denied.items()))
        return Finding(FAIL, check, f"connections to {what} were refused by macOS", how)
    return Finding(OK, check, f"reached {', '.join(sorted(f.local_network_probes))}")


def probe_addresses(env: dict[str, str]) -> list[tuple[str, int]]:
    """Where to test the Local Network permission: MASTER_ADDR (not loopback, which needs no permission)
    on MASTER_PORT, else port 9: any port tells, since a refusal by the peer means the packet got through."""
    addr = env.get("MASTER_ADDR", "").strip()
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit() else 9
    if not addr or addr.startswith("127.") or addr == "localhost":
        return []
    return [(addr, port or 9)]


def probe_connect(target: tuple[str, int], timeout: float = 2.0) -> int:
    """errno of a TCP connect to `target`, 0 when it connected or the peer refused (reached)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(target)
        except ConnectionRefusedError:
            return 0
        except socket.timeout:
            return errno.ETIMEDOUT
        except OSError as exc:
            return exc.errno or -1
    return 0


def choose(env: dict[str, str], store_host: str, interfaces: dict[str, list[str]]) -> tuple[list[str], str]:
    """(addresses, error) of the job's own choice (`choose_addresses`, as rendezvous/tcp.py calls it with the
    store's host, which is MASTER_ADDR under env://)."""
    from .transport.netif import choose_addresses

    try:
        return choose_addresses(Config.parse_env(env)[0].ifnames, store_host or None, interfaces), ""
    except ConfigError as exc:
        return [], str(exc)


def probe_store_once(env: dict[str, str], timeout: float = 2.0) -> str:
    """One TCP connection to MASTER_ADDR:MASTER_PORT: "accepted", "refused", or the errno's name; "" when
    either is unset."""
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if not addr or not port.isdigit():
        return ""
    try:
        with socket.create_connection((addr, int(port)), timeout=timeout):
            return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "ETIMEDOUT"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))


def gather_facts(run: Callable[[list[str]], Any] | None = None, plat: Platform | None = None) -> Facts:
    """The I/O shell: reads this machine. Never raises for a missing tool."""
    from .rendezvous.tcp import congestion_control_problem, effective_socket_buffer
    from .topology.discover import discover_local, subprocess_runner
    from .transport.netif import local_interfaces

    run = run or subprocess_runner
    try:
        import torch
        import torch.distributed as dist

        from .backend.registration import register

        register()
        torch_version, registered = torch.__version__, "thunderbolt" in dist.Backend.backend_list
    except ImportError:
        torch_version, registered = None, False
    try:
        host = discover_local(run)
        tb = [p.ifname for p in host.ports if p.ifname]
        mtus = {p.ifname: p.mtu for p in host.ports if p.ifname and p.mtu}
        speeds = {p.ifname: p.speed_gbps for p in host.ports if p.ifname}
        bridge = list(host.bridge.members) if host.bridge else []
        topology = host.to_json()
    except Exception:  # noqa: BLE001 - discovery problems are reported by `topo`, not here
        tb, mtus, speeds, bridge, topology = [], {}, {}, [], {}
    plat = plat or current()
    env = dict(os.environ)
    cfg = Config.parse_env(env)[0]  # (a bad setting is reported by the configuration check)
    try:
        effective = effective_socket_buffer(cfg, plat)
    except (ConfigError, OSError):
        effective = 0  # a bad configuration is reported by its own check
    cc_error = congestion_control_problem(cfg.congestion_control, plat)
    probes = ({f"{a}:{p}": probe_connect((a, p)) for a, p in probe_addresses(env)}
              if plat.local_network_privacy else {})
    interfaces = local_interfaces()
    store_host = env.get("MASTER_ADDR", "").strip()
    chosen, choice_error = choose(env, store_host, interfaces)
    wants_rdma = plat.name == "darwin" or cfg.transport == "rdma" or cfg.verbs == "fake"
    rdma = gather_rdma(run, plat, env, speeds) if wants_rdma else None
    return Facts(system=platform.system(), python=platform.python_version(), torch=torch_version,
                 backend_registered=registered, env=env, interfaces=interfaces,
                 store_host=store_host, chosen_addresses=chosen, choice_error=choice_error,
                 store_probe=probe_store_once(env), cc_error="" if cc_error is None else str(cc_error),
                 thunderbolt_ifnames=tb, mtus=mtus,
                 congestion_control=_read_first("/proc/sys/net/ipv4/tcp_congestion_control") if plat.has_proc else "",
                 max_socket_buffer=(int(_read_first("/proc/sys/net/core/rmem_max") or 0) if plat.has_proc else 0)
                 or _macos_maxsockbuf(run, plat),
                 bridge_members=bridge, effective_socket_buffer=effective,
                 local_network_privacy=plat.local_network_privacy, local_network_probes=probes, rdma=rdma,
                 topology=topology, firewall=gather_firewall(run, plat), pmset=_macos_pmset(run, plat))


def _read_first(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _macos_maxsockbuf(run: Callable, plat: Platform) -> int:
    if plat.name != "darwin":
        return 0
    res = run([SYSCTL, "-n", "kern.ipc.maxsockbuf"])
    try:
        return int(res.stdout.strip())
    except (ValueError, AttributeError):
        return 0


def _macos_pmset(run: Callable, plat: Platform) -> tuple[str, str] | None:
    """A Mac's `pmset -g batt` and `pmset -g` output ("" where one failed); None elsewhere."""
    if plat.name != "darwin":
        return None
    batt, settings = (getattr(run([PMSET, *args]), "stdout", "") or "" for args in (["-g", "batt"], ["-g"]))
    return batt, settings
