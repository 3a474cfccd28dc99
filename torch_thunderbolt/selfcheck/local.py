"""Starting a selfcheck's ranks: two on this machine, or every host of a hostfile through `launch` after
checking that each host answers. Torch-free (the ranks import it)."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from ..bench import spawn
from ..launch.hostfile import Host
from .model import FAIL, LEAD_STUCK, Line, Options, format_line

ANSWER_SECONDS = 8.0  # how long a host gets to answer `true` over its way in


def _whole_run_seconds(opts: Options) -> float:
    """A bound on the whole run, beyond every check's own deadline, so that nothing is left waiting."""
    return 60.0 + opts.check_timeout * 4


def run_here(opts: Options, argv: Sequence[str]) -> int:
    """`opts.nproc` ranks of `python -m torch_thunderbolt selfcheck` on 127.0.0.1; rank 0 prints. Names the
    ranks still running if the whole run outlasts its bound."""
    port = spawn.free_port()
    procs: list[subprocess.Popen] = []
    # One fresh secret authenticates the job's TCP streams, as `launch` gives one (the user's own wins).
    base = dict(os.environ)
    base["THUNDERBOLT_SECRET"] = base.get("THUNDERBOLT_SECRET", "").strip() or secrets.token_hex(32)
    previous = signal.signal(signal.SIGTERM, spawn._raise_terminated)
    try:
        print(f"# starting {opts.nproc} ranks of the selfcheck on this machine", flush=True)
        for rank in range(opts.nproc):
            env = spawn.child_env(base, rank, opts.nproc, port)
            procs.append(subprocess.Popen([sys.executable, "-m", "torch_thunderbolt", "selfcheck", *argv], env=env,
                                          start_new_session=True))
        deadline = time.monotonic() + _whole_run_seconds(opts)
        while procs[0].poll() is None and time.monotonic() < deadline:
            if any(p.poll() == LEAD_STUCK for p in procs[1:]):
                return 1  # another rank named rank 0 stuck and wrote the report: nothing more will come
            time.sleep(spawn.POLL_SECONDS)
        if procs[0].poll() is None:
            alive = [r for r, p in enumerate(procs) if p.poll() is None]
            print(format_line(Line(FAIL, "selfcheck", f"rank(s) {', '.join(map(str, alive))} still running after "
                                   f"{_whole_run_seconds(opts):g} s: stuck; stopped",
                                   "look at the stuck rank's output above", ranks=alive)), flush=True)
            return 1
        # Rank 0 ends after writing the report; the others end with it (or stay stuck where it named them).
        end = time.monotonic() + 10
        while any(p.poll() is None for p in procs[1:]) and time.monotonic() < end:
            time.sleep(spawn.POLL_SECONDS)
        return procs[0].returncode or int(any((p.returncode or 0) > 0 for p in procs[1:]))
    finally:
        spawn._stop(procs)
        signal.signal(signal.SIGTERM, previous)


def answers(host: Host, ssh_options: Sequence[str] = ()) -> str | None:
    """None when `host` runs a command through its way in (ssh, its lab namespace, here), else why not."""
    if host.exec == "local":
        return None
    if host.exec == "lab":
        namespace = host.namespace or f"{host.lab}-{host.name}"
        argv = ["ip", "netns", "exec", namespace, "true"]
    else:
        if shutil.which("ssh") is None:
            return "ssh is not installed here"
        # ssh takes the first value given for an option: the user's --ssh-option go first.
        argv = ["ssh", *ssh_options, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(ANSWER_SECONDS)}",
                host.ssh or host.name, "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=ANSWER_SECONDS + 2,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"no answer within {ANSWER_SECONDS + 2:g} s to `{' '.join(argv)}`"
    except OSError as exc:
        return f"`{argv[0]}` cannot run: {exc}"
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[-1]
        return f"`{' '.join(argv)}` failed: {why}"
    return None


def run_hostfile(opts: Options, hostfile: str, argv: Sequence[str], ssh_options: Sequence[str] = ()) -> int:
    """Check that every host answers (one FAIL line per host that does not), then launch the selfcheck on all."""
    from ..cli.main import main
    from ..launch.hostfile import read_hostfile

    hosts = read_hostfile(hostfile)
    start = time.monotonic()
    # Every host at once: a host that does not answer costs its timeout once, not once per host.
    with ThreadPoolExecutor(max_workers=len(hosts) or 1) as pool:
        whys = list(pool.map(lambda h: answers(h, ssh_options), hosts))
    seconds = time.monotonic() - start
    silent = [(h, why) for h, why in zip(hosts, whys) if why is not None]
    for h, why in silent:
        print(format_line(Line(FAIL, f"host {h.name} answers", why,
                               f"is {h.name} up, on the network, and does `ssh {h.ssh or h.name} true` work "
                               "without a password (ssh-copy-id)?", seconds=seconds)), flush=True)
    if silent:
        return 1
    launch = ["launch", "--hostfile", hostfile, *[f"--ssh-option={o}" for o in ssh_options], "--",
              "python", "-m", "torch_thunderbolt", "selfcheck", *argv]
    return main(launch)
