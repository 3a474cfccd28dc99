"""Launch plumbing shared by the examples: choose the backend, start the ranks, time communication.

An example runs either under torchrun (RANK/WORLD_SIZE in the environment, rendezvous through env://) or
starts its own `--nproc` local ranks on a free port of 127.0.0.1. Backend "thunderbolt" needs the
torch_thunderbolt package; when `--backend` is not given it is used if it imports, gloo otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    local_world: int
    backend: str


def _add_checkout_to_path() -> None:
    # Running `python examples/x.py` from a source checkout: make the package next to examples/ importable.
    root = Path(__file__).resolve().parents[2]
    if (root / "torch_thunderbolt" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))


def import_thunderbolt() -> Any:
    """Import torch_thunderbolt (it registers backend "thunderbolt"); ImportError if it is not there."""
    _add_checkout_to_path()
    import torch_thunderbolt  # noqa: PLC0415 - optional dependency, imported on demand
    return torch_thunderbolt


def default_backend() -> str:
    try:
        import_thunderbolt()
    except ImportError:
        return "gloo"
    return "thunderbolt" if "thunderbolt" in dist.Backend.backend_list else "gloo"


def resolve_backend(name: str | None) -> str:
    if name is None:
        return default_backend()
    if name == "thunderbolt":
        try:
            import_thunderbolt()
        except ImportError as exc:
            raise ValueError(f"backend 'thunderbolt' needs the torch_thunderbolt package ({exc})") from exc
        if "thunderbolt" not in dist.Backend.backend_list:
            raise ValueError("torch_thunderbolt imported but did not register backend 'thunderbolt'")
    return name


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None,
                        help="torch.distributed backend (default: thunderbolt if torch_thunderbolt "
                             "imports, else gloo)")
    parser.add_argument("--nproc", type=int, default=2,
                        help="local ranks to start when not under torchrun (default 2)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per rank (default: cores / local ranks)")
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                        help="write the results of rank 0 as JSON to OUT")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Worker = Callable[[argparse.Namespace, RankInfo], "dict[str, Any] | None"]


def launch(worker: Worker, args: argparse.Namespace) -> int:
    """Run `worker(args, info)` on every rank; rank 0's returned dict is printed/written as JSON."""
    args.backend = resolve_backend(args.backend)
    if under_torchrun():
        _rank_main(int(os.environ["RANK"]), worker, args, int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])), "env://")
        return 0
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    init = f"tcp://127.0.0.1:{free_port()}"
    if args.nproc == 1:
        _rank_main(0, worker, args, 1, 1, init)
        return 0
    import torch.multiprocessing as mp  # noqa: PLC0415 - only the spawning parent needs it

    # join=True: if one rank raises, the others are terminated and the error is re-raised here.
    mp.start_processes(_rank_main, args=(worker, args, args.nproc, args.nproc, init),
                       nprocs=args.nproc, join=True, start_method="spawn")
    return 0


def _rank_main(rank: int, worker: Worker, args: argparse.Namespace, world: int, local_world: int,
               init_method: str) -> None:
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    if args.backend == "thunderbolt":
        import_thunderbolt()  # a spawned child starts with a fresh interpreter: register again
    dist.init_process_group(args.backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        result = worker(args, RankInfo(rank, world, local_world, args.backend))
        if rank == 0 and result is not None:
            emit(result, args.json_out)
    finally:
        dist.destroy_process_group()


def emit(result: dict[str, Any], json_out: str | None) -> None:
    if json_out:
        Path(json_out).write_text(json.dumps(_finite(result), indent=2, allow_nan=False) + "\n")
        print(f"wrote {json_out}")


def _finite(value: Any) -> Any:
    # NaN (a figure that was not measured) is not JSON: write null instead.
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def run_main(main: Callable[[], int]) -> None:
    """Exit with main()'s code; bad arguments become one line on stderr, not a traceback."""
    try:
        code = main()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # noqa: BLE001 - a failed rank: show its message, not the spawn wrapper's
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


class CommTimer:
    """Wall time spent inside send/recv calls (including waiting for the peer to be ready)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        t0 = time.perf_counter()
        dist.send(tensor, dst)
        self._add(t0)

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        t0 = time.perf_counter()
        work = dist.isend(tensor, dst)
        self._add(t0)
        return work

    def wait(self, work: Any) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.seconds += time.perf_counter() - t0

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.recv(tensor, src)
        self._add(t0)
        return tensor

    def _add(self, t0: float) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return float("nan")
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps requested but MPS is not available on this machine")
    return torch.device(name)
