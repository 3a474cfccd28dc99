"""Pipeline-parallel LLM inference: a Llama-style decoder split by layers over N ranks, greedy decoding.

Stage s runs its layers and sends the hidden states to stage s+1; the last stage picks the next token and
sends it back to stage 0 (explicit send/recv). With `--microbatches M` the batch is cut into M pieces that
travel through the stages one after another, so different stages work on different pieces at once.

Rank 0 first runs the whole model alone (the 1-process reference, same seed → same weights), then the
ranks run the pipeline; the pipeline's tokens must equal the reference's. Reported per batch size:
prefill ms, decode ms/token, tokens/s, time inside send/recv per rank, and a send/recv round trip of one
activation so backends can be compared on the transfer itself.

    python examples/pipeline_inference.py --backend gloo --preset tiny --tokens 16 --batch 1 4
    torchrun --nproc-per-node 2 examples/pipeline_inference.py --preset h4096 --json out.json
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from models.launch import (CommTimer, RankInfo, add_launch_args, launch, median, pick_device, run_main,
                           under_torchrun)
from torch_thunderbolt.testing.models.llama import (PRESETS, LlamaStage, build_stage, human_params, make_config,
                                                    share_stage, split_layers)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=16, help="tokens to generate per sequence")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes to run (default 1 4)")
    p.add_argument("--microbatches", type=int, default=1, help="pieces each batch is cut into (<= batch)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "mps"],
                   help="compute device (auto: mps if available, else cpu); activations travel as "
                        "CPU tensors")
    p.add_argument("--checkpoint", default=None, help="whole-model state dict (torch.save) to load")
    p.add_argument("--pingpong", type=int, default=20, help="activation round trips to time (0: skip)")
    for name in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab-size"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    args = p.parse_args(argv)
    _validate(args)
    return args


def _validate(args: argparse.Namespace) -> None:
    if args.tokens < 1 or args.prompt_len < 1:
        raise ValueError("--tokens and --prompt-len must be >= 1")
    if min(args.batch) < 1 or args.microbatches < 1:
        raise ValueError("--batch and --microbatches must be >= 1")
    if args.microbatches > min(args.batch):
        raise ValueError(f"--microbatches {args.microbatches} exceeds the smallest --batch {min(args.batch)}")
    cfg = config_from_args(args)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    split_layers(cfg.layers, world)  # raises if there are fewer layers than ranks


def config_from_args(args: argparse.Namespace):
    cfg = make_config(args.preset, layers=args.layers, hidden=args.hidden, heads=args.heads,
                      kv_heads=args.kv_heads, intermediate=args.intermediate, vocab_size=args.vocab_size)
    return replace(cfg, max_seq=max(cfg.max_seq, args.prompt_len + args.tokens))


def make_prompt(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed + 7))


@dataclass(frozen=True)
class DecodeSpec:
    batch: int
    prompt_len: int
    new_tokens: int
    microbatches: int = 1


def decode(stage: LlamaStage, rank: int, n_stages: int, prompt: torch.Tensor | None, spec: DecodeSpec,
           device: torch.device, timer: CommTimer) -> dict[str, Any]:
    """Greedy decoding through `n_stages` ranks (or alone if 1); `prompt` is needed on rank 0 only.
    Every rank returns its total and send/recv seconds; rank 0 also the tokens and the rates."""
    batch, prompt_len, new_tokens, microbatches = (spec.batch, spec.prompt_len, spec.new_tokens,
                                                   spec.microbatches)
    last, s = n_stages - 1, rank
    sizes = [len(c) for c in torch.arange(batch).tensor_split(microbatches)]
    caches = [stage.new_caches(n) for n in sizes]
    dtype, hidden = next(stage.parameters()).dtype, stage.cfg.hidden
    tokens: list[list[torch.Tensor]] = [[torch.empty(0)] * microbatches for _ in range(new_tokens)]
    ready_at = [0.0] * new_tokens  # when all pieces of a step's tokens are known on rank 0
    pending: list[tuple[Any, torch.Tensor]] = []
    pieces = prompt.tensor_split(microbatches) if prompt is not None else None

    def take_tokens(step: int, m: int, tok: torch.Tensor) -> None:
        tokens[step][m] = tok
        if m == microbatches - 1:
            ready_at[step] = time.perf_counter()

    start = time.perf_counter()
    for step in range(new_tokens):
        pos, length = (0, prompt_len) if step == 0 else (prompt_len + step - 1, 1)
        for m, n in enumerate(sizes):
            if s == 0 and step == 0:
                x = pieces[m]
            elif s == 0:
                if n_stages > 1:
                    take_tokens(step - 1, m, timer.recv(torch.empty(n, dtype=torch.int64), last))
                x = tokens[step - 1][m][:, None]
            else:
                x = timer.recv(torch.empty(n, length, hidden, dtype=dtype), s - 1)
            y = stage(x.to(device), caches[m], pos)
            if s == last:
                tok = y[:, -1].argmax(-1).cpu()
                if n_stages == 1:
                    take_tokens(step, m, tok)
                else:
                    pending.append((timer.isend(tok, 0), tok))
            else:
                out = y.cpu().contiguous()
                pending.append((timer.isend(out, s + 1), out))
        # Sends must complete before their buffers go; waiting once per step keeps pieces flowing.
        for work, _ in pending:
            timer.wait(work)
        pending.clear()
    if s == 0 and n_stages > 1:
        for m, n in enumerate(sizes):
            take_tokens(new_tokens - 1, m, timer.recv(torch.empty(n, dtype=torch.int64), last))
    total = time.perf_counter() - start
    result: dict[str, Any] = {"total_s": total, "comm_s": timer.seconds}
    if s == 0:
        result["tokens"] = torch.stack([torch.cat(step) for step in tokens], dim=1)
        result["prefill_ms"] = (ready_at[0] - start) * 1e3
        decode_s = ready_at[-1] - ready_at[0]
        result["ms_per_token"] = decode_s / (new_tokens - 1) * 1e3 if new_tokens > 1 else float("nan")
        result["tokens_per_s"] = batch / (result["ms_per_token"] / 1e3) if new_tokens > 1 else float("nan")
    return result


def activation_round_trip_us(info: RankInfo, batch: int, hidden: int, dtype: torch.dtype,
                             reps: int) -> float:
    """Median round trip between ranks 0 and 1 of what one decode step moves: hidden 0→1, token 1→0."""
    if info.world < 2 or reps < 1 or info.rank > 1:
        return float("nan")
    act, tok = torch.ones(batch, 1, hidden, dtype=dtype), torch.zeros(batch, dtype=torch.int64)
    samples = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        if info.rank == 0:
            dist.send(act, 1)
            dist.recv(tok, 1)
        else:
            dist.recv(act, 0)
            dist.send(tok, 0)
        samples.append(time.perf_counter() - t0)
    return median(samples[2:]) * 1e6


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values`, as rank-ordered lists (a tiny all_gather)."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def summarise(mode: str, batch: int, stages: int, microbatches: int, res: dict[str, Any]) -> dict[str, Any]:
    return {"mode": mode, "batch": batch, "stages": stages, "microbatches": microbatches,
            "prefill_ms": res["prefill_ms"], "ms_per_token": res["ms_per_token"],
            "tokens_per_s": res["tokens_per_s"], "tokens": res["tokens"].tolist()}


def worker(args: argparse.Namespace, info: RankInfo) -> dict[str, Any] | None:
    cfg = config_from_args(args)
    device, dtype = pick_device(args.device), DTYPES[args.dtype]
    ckpt = torch.load(args.checkpoint, map_location="cpu", mmap=True, weights_only=True) \
        if args.checkpoint else None
    ranges = split_layers(cfg.layers, info.world)
    mine = ranges[info.rank]
    first, last = info.rank == 0, info.rank == info.world - 1
    # Rank 0 holds the whole model for the reference and uses a slice of it (no copy) as its stage.
    full = build_stage(cfg, range(cfg.layers), True, True, args.seed, dtype, device, ckpt) if first else None
    stage = share_stage(full, mine, first, last) if first else \
        build_stage(cfg, mine, first, last, args.seed, dtype, device, ckpt)
    runs = []
    for batch in args.batch:
        prompt = make_prompt(cfg.vocab_size, batch, args.prompt_len, args.seed)
        ref = None
        if first:
            ref = decode(full, 0, 1, prompt, DecodeSpec(batch, args.prompt_len, args.tokens), device,
                         CommTimer())
            runs.append(summarise("1-process", batch, 1, 1, ref))
        dist.barrier()
        if info.world == 1:
            continue
        timer = CommTimer()
        spec = DecodeSpec(batch, args.prompt_len, args.tokens, args.microbatches)
        res = decode(stage, info.rank, info.world, prompt if first else None, spec, device, timer)
        per_rank = gather_floats([res["comm_s"], res["total_s"]])
        rtt = activation_round_trip_us(info, batch // args.microbatches, cfg.hidden, dtype, args.pingpong)
        dist.barrier()
        if first:
            row = summarise("pipeline", batch, info.world, args.microbatches, res)
            row["comm_s_per_rank"] = [c for c, _ in per_rank]
            row["comm_share_per_rank"] = [c / t for c, t in per_rank]
            row["act_round_trip_us"] = rtt
            # Per piece and step: S-1 activation hops + 1 token hop, each about half a round trip.
            row["transfer_share_est"] = (args.microbatches * info.world / 2 * rtt / 1e3) / res["ms_per_token"]
            row["tokens_equal"] = bool(torch.equal(res["tokens"], ref["tokens"]))
            runs.append(row)
            if not row["tokens_equal"]:
                raise AssertionError(f"batch {batch}: pipeline tokens differ from the 1-process run:\n"
                                     f"{res['tokens'].tolist()}\nvs\n{ref['tokens'].tolist()}")
    if not first:
        return None
    result = {"example": "pipeline_inference", "backend": info.backend, "world_size": info.world,
              "preset": args.preset, "config": asdict(cfg), "params": cfg.param_count(),
              "dtype": args.dtype, "device": str(device), "threads_per_rank": torch.get_num_threads(),
              "prompt_len": args.prompt_len, "new_tokens": args.tokens,
              "layers_per_stage": [len(r) for r in ranges], "torch": torch.__version__, "runs": runs}
    print(format_table(result))
    return result


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"pipeline inference: backend {result['backend']}, preset {result['preset']} (hidden "
             f"{cfg['hidden']}, {cfg['layers']} layers, {human_params(result['params'])} params, "
             f"{result['dtype']}), {result['world_size']} ranks, "
             f"{result['threads_per_rank']} thread(s)/rank, "
             f"prompt {result['prompt_len']}, {result['new_tokens']} new tokens",
             f"{'batch':>5} {'mode':<10} {'stages':>6} {'mb':>3} {'prefill ms':>10} {'ms/token':>9} "
             f"{'tokens/s':>9} {'in send/recv per rank':>22} {'act RTT us':>10} {'equal':>5}"]
    for r in result["runs"]:
        share = " / ".join(f"{100 * x:.0f}%" for x in r.get("comm_share_per_rank", [])) or "-"
        rtt = f"{r['act_round_trip_us']:.0f}" if "act_round_trip_us" in r else "-"
        lines.append(f"{r['batch']:>5} {r['mode']:<10} {r['stages']:>6} {r['microbatches']:>3} "
                     f"{r['prefill_ms']:>10.1f} {r['ms_per_token']:>9.2f} {r['tokens_per_s']:>9.1f} "
                     f"{share:>22} {rtt:>10} {str(r.get('tokens_equal', '-')):>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(worker, args)


if __name__ == "__main__":
    run_main(main)
