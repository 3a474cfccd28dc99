"""Benchmark configuration: command-line flags <-> BenchConfig <-> argv, the launcher environment, and the
thunderbolt backend's settings for a run (`backend_config`: the job's THUNDERBOLT_* as config.py parses
them, with --transport in place of THUNDERBOLT_TRANSPORT; handed to the backend's groups, never written
into the environment).

`to_argv` is the inverse of parsing, so locally spawned ranks are re-invoked with exactly the
configuration the user asked for.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..config import TRANSPORTS, Config
from ..errors import ConfigError
from . import sizes as sz
from .bounds import parse_cable_rate
from .spec import DTYPES, FLOOR_LABEL, NULL_BACKEND, OP_ALIASES, OPS, check_world_size, dtype
from .workloads import spec as ws

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.#:-]+$")


@dataclass(frozen=True)
class BackendSpec:
    label: str  # unique name in tables and JSON ("gloo", "gloo#2", or user-given)
    kind: str   # the torch.distributed backend name passed to new_group


@dataclass(frozen=True)
class BenchConfig:
    backends: tuple[BackendSpec, ...]
    baseline: str | None
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    nproc: int = 2
    link: bool = False
    link_streams: tuple[int, ...] = (1, 2, 4)
    link_bytes: int = 256 << 20
    link_repeats: int = 3
    memcpy: bool = False
    floor: bool = False              # also measure the null backend (the dispatch floor)
    cable_rate: str | None = None    # per cable and direction, tc-style ("10gbit"); None: no cable bound
    transport: str | None = None
    json_path: str | None = None
    plot_path: str | None = None
    timeout: float = 1800.0
    progress: bool = True
    workload: str | None = None      # --workload: a model's step or token timed instead of single ops
    device: str = ws.DEFAULT_DEVICE  # where the workload's model runs (workloads.spec.DEVICES)
    model: str | None = None         # the model's preset (None: the workload's default)
    batches: tuple[int, ...] = ()    # per rank (vit-ddp) or per job (llama-*)
    ddp_hooks: tuple[str, ...] = ("none",)
    bucket_caps: tuple[float, ...] = (25.0,)
    microbatches: int = 1
    timeline: bool = False           # vit-ddp: one traced step per case and backend (buckets and device spans)
    tokens: int = 8                  # decoded tokens per timed iteration (llama-*)
    tp_impl: str = ws.DEFAULT_TP_IMPL  # llama-tp: how the decoder is split (workloads.spec.TP_IMPLS)


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a job started by torchrun, our launcher, or our own spawner."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def parse_backends(text: str) -> tuple[BackendSpec, ...]:
    """'thunderbolt,gloo' / 'gloo,gloo' (-> gloo, gloo#2) / 'a=gloo,b=gloo' (explicit labels)."""
    specs: list[BackendSpec] = []
    for item in sz.split_list(text, "backends"):
        label, _, kind = item.rpartition("=")
        kind = kind.strip().lower()
        label = label.strip() or kind
        if not _LABEL_RE.match(label) or not re.match(r"^[a-z][a-z0-9_]*$", kind):
            raise ConfigError(f"bad --backends entry {item!r}: expected BACKEND or LABEL=BACKEND, e.g. gloo")
        if kind == NULL_BACKEND:  # never checked, never a baseline by default: it is not a backend
            raise ConfigError(f"bad --backends entry {item!r}: the null backend is measured with --floor")
        taken = {s.label for s in specs}
        if label in taken and "=" in item:
            raise ConfigError(f"duplicate backend label {label!r} in --backends")
        number = 2
        base = label
        while label in taken:
            label, number = f"{base}#{number}", number + 1
        specs.append(BackendSpec(label, kind))
    return tuple(specs)


def measured_backends(cfg: BenchConfig) -> tuple[BackendSpec, ...]:
    """Every group a run creates and times, interleaved: the --backends, then the floor with --floor."""
    return cfg.backends + ((BackendSpec(FLOOR_LABEL, NULL_BACKEND),) if cfg.floor else ())


def default_baseline(backends: Sequence[BackendSpec]) -> str | None:
    """The ratio column compares against gloo when gloo is measured alongside something else."""
    if len(backends) < 2:
        return None
    return next((b.label for b in backends if b.kind == "gloo"), None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--nproc", type=int, default=2, help="local ranks to start (ignored when RANK/WORLD_SIZE are set)")
    a("--backends", default="thunderbolt,gloo", help="comma list, interleaved per size; LABEL=BACKEND to name")
    a("--baseline", default=None, help="label the ratio column compares to (default: gloo)")
    a("--ops", default="all", help=f"comma list of {', '.join(OPS)} or all")
    a("--sizes", default=None, help=f"comma list of sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})")
    a("-b", "--minbytes", default=None, help="nccl-tests style: first size")
    a("-e", "--maxbytes", default=None, help="nccl-tests style: last size")
    a("-f", "--stepfactor", type=float, default=2.0, help="nccl-tests style: size multiplier (default 2)")
    a("-n", "--iters", type=int, default=None,
      help=f"timed iterations per size and backend (default 20; {ws.DEFAULT_ITERS} with --workload)")
    a("-w", "--warmup", type=int, default=None,
      help=f"untimed iterations first (default 5; {ws.DEFAULT_WARMUP} with --workload)")
    a("-d", "--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    a("--link", action="store_true",
      help="also measure the raw TCP link between rank 0 and rank 1 (the eff column; the bound of TCP rows on one host)")
    a("--link-streams", default="1,2,4", help="TCP stream counts for --link (default 1,2,4)")
    a("--link-bytes", default="256M", help="bytes per --link throughput measurement (default 256M)")
    a("--link-repeats", type=int, default=3, help="--link measurements per stream count (median)")
    a("--memcpy", action="store_true",
      help="also measure single-core memcpy bandwidth on rank 0, before and after (shared-memory yardstick; "
           "the bound of shared-memory rows on one host)")
    a("--floor", action="store_true",
      help=f"also time a null Python process group ({FLOOR_LABEL!r}, interleaved, results not checked) whose calls "
           "do nothing: torch's own dispatch cost; adds an 'x floor' column = time / the floor's")
    a("--cable-rate", default=None, metavar="RATE",
      help="rate of one cable per direction (e.g. 1gbit, 10gbit, 40gbit): adds a 'bound' column = busbw / "
           "(rate x the cables each rank has, as the job discovers them from its networks), between hosts")
    a("--transport", choices=TRANSPORTS, default=None,
      help="the thunderbolt backend's kind of link (THUNDERBOLT_TRANSPORT's values; default: that variable)")
    a("--json", dest="json_path", metavar="FILE", default=None, help="write one record per result")
    a("--plot", dest="plot_path", metavar="FILE.png", default=None, help="plot busbw and latency (matplotlib)")
    a("--timeout", type=float, default=1800.0, help="seconds for the whole run (default 1800)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    w = parser.add_argument_group("workloads", "time a model's training step or decoded token instead of single ops")
    w.add_argument("--workload", choices=ws.WORKLOADS, default=None,
                   help="vit-ddp: ViT under DDP (step with and without the exchange, the exchange alone); "
                        "llama-pp / llama-tp: a Llama-shaped decoder, pipeline or tensor parallel over the ranks")
    w.add_argument("--device", choices=ws.DEVICES, default=None,
                   help=f"where the model runs (default {ws.DEFAULT_DEVICE}: the timed emulated Apple-silicon GPU, "
                        "timing only; fake: the untimed fake accelerator; cpu: this host's CPU)")
    w.add_argument("--model", default=None, help="the model's preset (default: ViT base, Llama llama8b)")
    w.add_argument("--batch", default=None, help="comma list of batch sizes (vit-ddp: images per rank, default "
                                                 "32; llama-*: sequences, default 1,4)")
    w.add_argument("--ddp-hook", default=None, help=f"vit-ddp: comma list of {', '.join(ws.DDP_HOOKS)} (default none)")
    w.add_argument("--bucket-cap-mb", default=None, help="vit-ddp: comma list of DDP bucket_cap_mb (default 25)")
    w.add_argument("--timeline", action="store_true", default=None,
                   help="vit-ddp: after the timed iterations, one traced step per case and backend: when each bucket's "
                        "all_reduce was issued and done, and when the device was busy (the timed device)")
    w.add_argument("--microbatches", type=int, default=None, help="llama-pp: pieces each batch is cut into (default 1)")
    w.add_argument("--tokens", type=int, default=None, help="llama-*: decoded tokens per timed iteration (default 8)")
    w.add_argument("--tp-impl", choices=ws.TP_IMPLS, default=None,
                   help=f"llama-tp: dtensor, PyTorch's parallelize_module (ColwiseParallel / RowwiseParallel over a "
                        f"DeviceMesh of each measured group); manual, hand-written Megatron shards with explicit "
                        f"all_reduces (default {ws.DEFAULT_TP_IMPL})")


def _float_list(text: str, what: str) -> tuple[float, ...]:
    values = []
    for item in sz.split_list(text, what):
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if value <= 0:
            raise ConfigError(f"bad --{what} entry {item!r}: expected a number > 0")
        values.append(value)
    return tuple(values)


_WORKLOAD_ONLY = ("device", "model", "batch", "ddp_hook", "bucket_cap_mb", "microbatches", "tokens", "timeline",
                  "tp_impl")


def _workload_fields(ns: argparse.Namespace) -> dict:
    """The --workload settings, checked against the workload (an option another workload ignores is an
    error, not a silent no-op)."""
    given = [f"--{k.replace('_', '-')}" for k in _WORKLOAD_ONLY if getattr(ns, k, None) is not None]
    if ns.workload is None:
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --workload")
        return {}
    collective_only = [flag for flag, on in (("--sizes", ns.sizes), ("-b/-e", ns.minbytes or ns.maxbytes),
                                             ("--ops", ns.ops != "all"), ("--link", ns.link), ("--memcpy", ns.memcpy),
                                             ("--floor", ns.floor), ("--plot", ns.plot_path),
                                             ("--cable-rate", ns.cable_rate)) if on]
    if collective_only:
        raise ConfigError(f"{', '.join(collective_only)} do not apply with --workload {ns.workload}")
    name = ns.workload
    wrong = [flag for flag, on in (("--ddp-hook", ns.ddp_hook is not None), ("--bucket-cap-mb", ns.bucket_cap_mb is not None),
                                   ("--timeline", ns.timeline is not None)) if on and name != "vit-ddp"]
    wrong += [flag for flag, on in (("--microbatches", ns.microbatches is not None),) if on and name != "llama-pp"]
    wrong += [flag for flag, on in (("--tokens", ns.tokens is not None),) if on and name == "vit-ddp"]
    wrong += [flag for flag, on in (("--tp-impl", ns.tp_impl is not None),) if on and name != "llama-tp"]
    if wrong:
        raise ConfigError(f"{', '.join(wrong)} do not apply to --workload {name}")
    out: dict = {"workload": name, "device": ns.device or ws.DEFAULT_DEVICE,
                 "model": ns.model or ws.DEFAULT_MODEL[name],
                 "batches": tuple(sz.parse_int_list(ns.batch, "batch")) if ns.batch else ws.DEFAULT_BATCHES[name]}
    if ns.ddp_hook is not None:
        out["ddp_hooks"] = tuple(sz.choose(sz.split_list(ns.ddp_hook, "ddp-hook"), ws.DDP_HOOKS, "--ddp-hook"))
    if ns.bucket_cap_mb is not None:
        out["bucket_caps"] = _float_list(ns.bucket_cap_mb, "bucket-cap-mb")
    if ns.timeline:
        out["timeline"] = True
    for flag, value in (("--microbatches", ns.microbatches), ("--tokens", ns.tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"bad {flag} {value}: expected at least 1")
    if ns.microbatches is not None:
        out["microbatches"] = ns.microbatches
        too_small = [b for b in out["batches"] if b % ns.microbatches and b >= ns.microbatches]
        if too_small:
            raise ConfigError(f"--microbatches {ns.microbatches} does not divide --batch {too_small[0]}")
    if ns.tokens is not None:
        out["tokens"] = ns.tokens
    if ns.tp_impl is not None:
        out["tp_impl"] = ns.tp_impl
    return out


def from_args(ns: argparse.Namespace) -> BenchConfig:
    """Validate parsed flags into a BenchConfig; every problem is a ConfigError naming the flag."""
    workload = _workload_fields(ns)
    iters = ns.iters if ns.iters is not None else (ws.DEFAULT_ITERS if workload else 20)
    warmup = ns.warmup if ns.warmup is not None else (ws.DEFAULT_WARMUP if workload else 5)
    if ns.sizes and (ns.minbytes or ns.maxbytes):
        raise ConfigError("give either --sizes or -b/-e/-f, not both")
    if ns.minbytes or ns.maxbytes:
        begin = sz.parse_size(ns.minbytes or ns.maxbytes)
        end = sz.parse_size(ns.maxbytes or ns.minbytes)
        sizes = sz.size_range(begin, end, ns.stepfactor)
    else:
        sizes = sz.parse_sizes(ns.sizes or DEFAULT_SIZES)
    backends = parse_backends(ns.backends)
    labels = [b.label for b in backends]
    floor = bool(ns.floor)
    if floor and FLOOR_LABEL in labels:
        raise ConfigError(f"--backends label {FLOOR_LABEL!r} is taken by --floor: name that backend otherwise")
    baseline = ns.baseline if ns.baseline is not None else default_baseline(backends)
    # The floor is a baseline only when asked for by name.
    allowed = labels + ([FLOOR_LABEL] if floor else [])
    if baseline is not None and baseline not in allowed:
        raise ConfigError(f"--baseline {baseline!r} is not one of the measured backends ({', '.join(allowed)})")
    for flag, value, low in (("--iters", iters, 1), ("--warmup", warmup, 0), ("--nproc", ns.nproc, 1),
                             ("--link-repeats", ns.link_repeats, 1)):
        if value < low:
            raise ConfigError(f"bad {flag} {value}: expected at least {low}")
    if ns.timeout <= 0:
        raise ConfigError(f"bad --timeout {ns.timeout}: expected seconds > 0")
    return BenchConfig(
        backends=backends, baseline=baseline,
        ops=tuple(sz.choose(sz.split_list(ns.ops, "ops"), OPS, "op", OP_ALIASES)),
        sizes=tuple(sizes), dtype=dtype(ns.dtype).name, iters=iters, warmup=warmup, nproc=ns.nproc,
        link=ns.link, link_streams=tuple(sz.parse_int_list(ns.link_streams, "link-streams")),
        link_bytes=sz.parse_size(ns.link_bytes), link_repeats=ns.link_repeats, memcpy=ns.memcpy,
        floor=floor, cable_rate=parse_cable_rate(ns.cable_rate), transport=ns.transport,
        json_path=ns.json_path, plot_path=ns.plot_path, timeout=ns.timeout, progress=ns.progress, **workload)


def to_argv(cfg: BenchConfig) -> list[str]:
    """Flags that parse back (through add_arguments + from_args) into exactly `cfg`."""
    argv = [
        "--nproc", str(cfg.nproc),
        "--backends", ",".join(f"{b.label}={b.kind}" for b in cfg.backends),
        "--ops", ",".join(cfg.ops), "--sizes", ",".join(str(s) for s in cfg.sizes),
        "--iters", str(cfg.iters), "--warmup", str(cfg.warmup), "--dtype", cfg.dtype,
        "--link-streams", ",".join(map(str, cfg.link_streams)), "--link-bytes", str(cfg.link_bytes),
        "--link-repeats", str(cfg.link_repeats), "--timeout", repr(cfg.timeout),
    ]
    if cfg.baseline is not None:
        argv += ["--baseline", cfg.baseline]
    for flag, value in (("--transport", cfg.transport), ("--json", cfg.json_path), ("--plot", cfg.plot_path),
                        ("--cable-rate", cfg.cable_rate)):
        if value is not None:
            argv += [flag, value]
    argv += ["--link"] if cfg.link else []
    argv += ["--memcpy"] if cfg.memcpy else []
    argv += ["--floor"] if cfg.floor else []
    argv += [] if cfg.progress else ["--no-progress"]
    if cfg.workload is not None:
        argv = _without(argv, ("--ops", "--sizes"))
        argv += ["--workload", cfg.workload, "--device", cfg.device, "--model", cfg.model or "",
                 "--batch", ",".join(map(str, cfg.batches))]
        if cfg.workload == "vit-ddp":
            argv += ["--ddp-hook", ",".join(cfg.ddp_hooks), "--bucket-cap-mb", ",".join(map(repr, cfg.bucket_caps))]
            argv += ["--timeline"] if cfg.timeline else []
        else:
            argv += ["--tokens", str(cfg.tokens)]
        if cfg.workload == "llama-pp":
            argv += ["--microbatches", str(cfg.microbatches)]
        if cfg.workload == "llama-tp":
            argv += ["--tp-impl", cfg.tp_impl]
    return argv


def _without(argv: list[str], flags: Sequence[str]) -> list[str]:
    """`argv` less each of `flags` and its value."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def _int_env(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(f"bad {name}={environ[name]!r}: expected a whole number") from None


def rank_env(environ: Mapping[str, str]) -> RankEnv | None:
    """The torchrun-style environment, or None when this process should spawn its own ranks."""
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
    if missing:
        raise ConfigError(f"launched as a rank but {', '.join(missing)} not set: expected RANK, WORLD_SIZE, "
                          "MASTER_ADDR and MASTER_PORT (as torchrun sets them)")
    rank, world = _int_env(environ, "RANK"), _int_env(environ, "WORLD_SIZE")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    local = _int_env(environ, "LOCAL_RANK") if environ.get("LOCAL_RANK") else rank
    return RankEnv(rank, world, local, environ["MASTER_ADDR"], _int_env(environ, "MASTER_PORT"))


def backend_config(cfg: BenchConfig, environ: Mapping[str, str]) -> Config:
    """The thunderbolt backend's settings for this run: `environ`'s THUNDERBOLT_* parsed as a job parses them
    (a bad value is the same ConfigError), with --transport in place of THUNDERBOLT_TRANSPORT. The groups
    measured get it as their options (dist.new_group(pg_options=...))."""
    backend = Config.from_env(environ)
    return backend if cfg.transport is None else dataclasses.replace(backend, transport=cfg.transport)


def validate_for_world(cfg: BenchConfig, world_size: int) -> None:
    """Checks that need the world size, run before any process group exists."""
    if cfg.workload is not None:
        if cfg.workload == "llama-tp":
            from ..testing.models.llama import check_shards, make_config

            try:
                check_shards(make_config(cfg.model or "llama8b"), world_size)
            except ValueError as exc:
                raise ConfigError(f"--workload llama-tp over {world_size} ranks: {exc}") from None
        return
    check_world_size(list(cfg.ops), world_size, dtype(cfg.dtype))
    if cfg.link and world_size < 2:
        raise ConfigError("--link needs at least 2 ranks (it measures rank 0 <-> rank 1)")
