"""What the lab's cables carry for plain TCP sockets, every cable in both directions at once (root only).

    python scripts/lab_raw_cables.py --name shring3 --bytes 64M --runs 3

One receiver and one sender process per direction of every cable of lab NAME, each in its host's
namespace, one TCP stream each with the backend's default socket buffer and TCP_NODELAY. Prints each
flow's rate and the smallest and mean over the flows as a share of the lab's cable rate. This is what
the emulated cables deliver on this machine with no backend at all: the ceiling a collective's share of
the cable bound can approach. Over a 1500-byte MTU, TCP payload is at most ~0.96 of the line rate.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from torch_thunderbolt.config import Config, parse_size
from torch_thunderbolt.lab.blueprint import LabPlan, parse_rate
from torch_thunderbolt.lab.state import load_state

FIRST_PORT = 6100
SOCKET_BUFFER = Config().socket_buffer  # what the backend gives its streams by default

RECEIVER = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
    s.setsockopt(socket.SOL_SOCKET, opt, int(sys.argv[3]))
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
view, n, t0 = memoryview(bytearray(4 << 20)), 0, None
while True:
    k = c.recv_into(view)
    if t0 is None:
        t0 = time.perf_counter()  # from the first byte: process start-up is not the cable's
    if not k:
        break
    n += k
print(n / (time.perf_counter() - t0), flush=True)
"""

SENDER = r"""
import socket, sys
c = socket.socket()
for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
    c.setsockopt(socket.SOL_SOCKET, opt, int(sys.argv[3]))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.connect((sys.argv[1], int(sys.argv[2])))
view, left = memoryview(bytearray(4 << 20)), int(sys.argv[4])
while left > 0:
    left -= c.send(view[:min(left, len(view))])
c.close()
"""


def flows(plan: LabPlan) -> list[tuple[str, str, str, int]]:
    """(sender namespace, receiver namespace, receiver address, port) for both directions of every cable."""
    out, port = [], FIRST_PORT
    for cable in plan.cables:
        a, b = plan.namespaces[cable.a], plan.namespaces[cable.b]
        out += [(a, b, cable.addr_b, port), (b, a, cable.addr_a, port + 1)]
        port += 2
    return out


def run_once(lab: LabPlan, nbytes: int, timeout: float) -> list[float]:
    """Rates in bytes/s of every flow, all started together."""
    plan = flows(lab)
    receivers = [subprocess.Popen(["ip", "netns", "exec", dst, sys.executable, "-c", RECEIVER, addr, str(port),
                                   str(SOCKET_BUFFER)], stdout=subprocess.PIPE, text=True)
                 for _src, dst, addr, port in plan]
    senders: list[subprocess.Popen] = []
    try:
        for r in receivers:
            if r.stdout is None or r.stdout.readline().strip() != "ready":
                raise RuntimeError("a receiver did not start; is the lab up and are you root?")
        senders = [subprocess.Popen(["ip", "netns", "exec", src, sys.executable, "-c", SENDER, addr, str(port),
                                     str(SOCKET_BUFFER), str(nbytes)])
                   for src, _dst, addr, port in plan]
        deadline = time.monotonic() + timeout
        for s in senders:
            s.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [float(r.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]) for r in receivers]
    finally:
        for p in senders + receivers:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="lab name (lab up --name)")
    ap.add_argument("--bytes", default="64M", help="bytes per flow (default 64M)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    args = ap.parse_args()
    lab = load_state(args.name)
    rate = parse_rate(lab.rate)[1] / 8
    if not rate:
        sys.exit(f"lab {args.name} is unshaped: there is no cable rate to compare with")
    for run in range(args.runs):
        rates = run_once(lab, parse_size(args.bytes), args.timeout)
        shares = [r / rate for r in rates]
        print(f"run {run + 1}: {len(rates)} flows, MB/s " + " ".join(f"{r / 1e6:.0f}" for r in rates)
              + f"; share of the cable rate: min {min(shares):.2f}, mean {statistics.fmean(shares):.2f}")


if __name__ == "__main__":
    main()
