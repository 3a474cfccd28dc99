#!/usr/bin/env python3
"""Times of shrink and split (RELIABILITY.md, "Shrink and split"), on one host or on an emulated cluster.

    python scripts/shrink_times.py loss --transport tcp --runs 5     # one host, 3 ranks
    python scripts/shrink_times.py loss --transport shm --runs 5
    sudo .venv/bin/python scripts/shrink_times.py loss --lab --runs 5          # 3 emulated Macs (a ring), TCP
    python scripts/shrink_times.py mesh --runs 5                     # 2x2 DeviceMesh, 4 ranks, one host
    sudo .venv/bin/python scripts/shrink_times.py mesh --lab --runs 5          # 4 emulated Macs (a mesh), TCP

`loss`: 3 ranks run small all_reduces; the last one SIGKILLs itself after saying when (tests/fault_tolerance/
programs/shrink.py `timing`); the two others catch the loss, call `dist.shrink_group` and run one all_reduce
on the shrunk group. Per run and survivor: the loss seen (error raised) and the first op done on the shrunk
group, in ms after the kill (one clock: every rank runs on this machine, labs included).

`mesh`: the time `init_device_mesh("cpu", (2, 2))` takes on each of 4 ranks, for this version
("thunderbolt": its subgroups split off the default group over its links), the previous main ("tbold", a
fresh set-up per subgroup: `git archive --old` as torch_thunderbolt_old, registered by
scripts/ab_previous), and gloo, interleaved run by run in the same way. Prints min-max over ranks and runs:
on a shared machine min-max over several runs, not one number, is what can be said.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torch_thunderbolt.testing.lab import lab_session, lab_setup  # noqa: E402
from torch_thunderbolt.testing.ranks import LOOPBACK, SHM, Setup, run_ranks  # noqa: E402

PREVIOUS_MAIN = "58b0ecd"  # the main before split and shrink
BACKENDS = ("thunderbolt", "tbold", "gloo")


def mesh_rank(backend: str) -> None:
    """One rank of `mesh`: the default group, one all_reduce (every link up), then the timed mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_thunderbolt  # noqa: F401 - registers the backend
    from torch_thunderbolt.testing.program import result

    dist.init_process_group(backend, init_method="env://")
    dist.all_reduce(torch.ones(10))
    dist.barrier()
    t0 = time.perf_counter()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    took = time.perf_counter() - t0
    for dim in ("dp", "tp"):  # (each dimension works)
        x = torch.ones(4)
        dist.all_reduce(x, group=mesh.get_group(dim))
        assert x.tolist() == [2.0] * 4, x
    result({"ms": took * 1000})
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def places(lab: bool, hosts: int, shm: bool = False) -> Iterator[Setup]:
    if lab:
        with lab_session(hosts, "ring" if hosts == 3 else "mesh", cc="reno") as cluster:
            yield lab_setup(cluster).with_env({"THUNDERBOLT_TRANSPORT": "tcp"})
    else:
        yield SHM.with_env({"THUNDERBOLT_TRANSPORT": "shm"}) if shm else LOOPBACK.with_env(
            {"THUNDERBOLT_TRANSPORT": "tcp"})


def span(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f} ms" if values else "-"


def loss(args: argparse.Namespace) -> None:
    from tests.fault_tolerance.programs import shrink

    seen, done = [], []
    with places(args.lab, 3, args.transport == "shm") as setup, tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            runs = run_ranks(shrink, 3, Path(tmp) / str(i), args=["timing"], setup=setup, timeout=120,
                             expect_ok=False)
            killed = runs[2].tagged("KILLED")[0]["at"]
            for res in runs[:2]:
                assert res.returncode == 0, res.stderr[-2000:]
                out = res.json()
                assert out["exact"], out
                seen.append((out["err_at"] - killed) * 1000)
                done.append((out["done_at"] - killed) * 1000)
            print(f"run {i}: loss seen {[round(s, 1) for s in seen[-2:]]} ms, first op on the shrunk group "
                  f"{[round(d, 1) for d in done[-2:]]} ms after the kill", flush=True)
    where = "3 emulated Macs (ring), tcp" if args.lab else f"one host, {args.transport}"
    print(f"{where}, {args.runs} runs x 2 survivors: loss seen {span(seen)}, first op on the shrunk group "
          f"{span(done)} after the kill")


def previous_main(directory: Path) -> Path:
    """The previous main's package as torch_thunderbolt_old in `directory` (what scripts/ab_previous imports)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_MAIN, "torch_thunderbolt"], check=True,
                             capture_output=True).stdout
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "x", "-C", str(directory), "--transform", "s/^torch_thunderbolt/torch_thunderbolt_old/"],
                   input=archive, check=True)
    return directory


def mesh(args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {b: [] for b in args.backends.split(",")}
    with places(args.lab, 4) as setup, tempfile.TemporaryDirectory() as tmp:
        if "tbold" in times:
            previous_main(Path(tmp) / "ab")
        ab = setup.but(pythonpath=(*setup.pythonpath, str(REPO / "scripts" / "ab_previous"), str(Path(tmp) / "ab")))
        ab = ab.with_env({"TB_AB_OLD": "1", "THUNDERBOLT_SECRET": secrets.token_hex(32)})
        for i in range(args.runs):
            for backend in times:
                runs = run_ranks(Path(__file__), 4, Path(tmp) / f"{i}-{backend}", args=["mesh-rank", backend],
                                 setup=ab, timeout=120)
                times[backend] += [res.json()["ms"] for res in runs]
            print(f"run {i}: " + ", ".join(f"{b} {span(t[-4:])}" for b, t in times.items()), flush=True)
    where = "4 emulated Macs (mesh), tcp" if args.lab else "one host, 4 ranks, tcp"
    print(f"2x2 DeviceMesh, {where}, {args.runs} runs x 4 ranks: " +
          ", ".join(f"{b} {span(t)}" for b, t in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("loss")
    p.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    p.add_argument("--lab", action="store_true")
    p.add_argument("--runs", type=int, default=5)
    p = sub.add_parser("mesh")
    p.add_argument("--lab", action="store_true")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p = sub.add_parser("mesh-rank")
    p.add_argument("backend")
    args = parser.parse_args()
    if args.what == "mesh-rank":
        mesh_rank(args.backend)
    elif args.what == "loss":
        loss(args)
    else:
        mesh(args)


if __name__ == "__main__":
    main()
