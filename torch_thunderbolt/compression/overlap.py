"""A large compressed all-reduce cut into pieces, encoding and decoding overlapped with the exchanges.

Unpipelined, a 64 MB int8 all-reduce spends its encode/decode time (~90 ms here) with the link idle and
its wire time (~140 ms at 1 Gbit/s) with the CPU idle. Cut into pieces, a second thread runs the
exchanges of piece k while this thread encodes piece k+2 and decodes piece k-1.

Both threads follow fixed orders, identical on every rank (ranks pair collectives by issue order):

    exchanges:  a2a(0) a2a(1) | ag(0) a2a(2) | ag(1) a2a(3) | ... | ag(K-2) | ag(K-1)
    local work: enc(0) enc(1) | red(0) enc(2) dec(-) | red(1) enc(3) dec(0) | ... | dec(K-1)

ag(k) needs red(k), red(k) needs a2a(k), which was issued before ag(k-1): no wait cycle. torch kernels
and socket calls release the GIL, so the two threads really run at once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .stages import Exchange, decode_result, encode_inputs, reduce_shard
from .codecs import Codec
from .scheme import chunk_layout, pipeline_pieces


def exchange_order(pieces: int) -> list[tuple[str, int]]:
    """The order in which the exchange thread issues the collectives of `pieces` pieces."""
    order = [("a2a", k) for k in range(min(2, pieces))]
    for k in range(pieces):
        order.append(("ag", k))
        if k + 2 < pieces:
            order.append(("a2a", k + 2))
    return order


@dataclass
class _Piece:
    flat: torch.Tensor
    out: torch.Tensor
    sent: Optional[torch.Tensor] = None
    received: Optional[torch.Tensor] = None
    mine: Optional[torch.Tensor] = None
    gathered: Optional[torch.Tensor] = None
    ready: dict[str, threading.Event] = field(default_factory=lambda: {"a2a": threading.Event(),
                                                                      "ag": threading.Event()})
    done: dict[str, threading.Event] = field(default_factory=lambda: {"a2a": threading.Event(),
                                                                     "ag": threading.Event()})


class _Failure:
    """The first error of either thread; setting it wakes every wait so nobody waits for a dead partner."""

    def __init__(self, pieces: list[_Piece]) -> None:
        self.error: Optional[BaseException] = None
        self._pieces = pieces

    def set(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for p in self._pieces:
            for ev in (*p.ready.values(), *p.done.values()):
                ev.set()

    def wait(self, event: threading.Event) -> None:
        event.wait()
        if self.error is not None:
            raise self.error


def _exchange_thread(pieces: list[_Piece], exchange: Exchange, failure: _Failure) -> None:
    try:
        for op, k in exchange_order(len(pieces)):
            p = pieces[k]
            failure.wait(p.ready[op])
            if op == "a2a":
                exchange.all_to_all(p.received, p.sent)
            else:
                exchange.all_gather(p.gathered, p.mine)
            p.done[op].set()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
        failure.set(exc)


def pipelined_all_reduce(
    flat: torch.Tensor, out: torch.Tensor, codec: Codec, exchange: Exchange, piece_elements: int
) -> None:
    """Sum fp32 `flat` ([numel]) across the exchange's ranks into `out` ([numel] fp32, may be `flat`)."""
    world = exchange.world_size
    bounds = pipeline_pieces(flat.numel(), piece_elements)
    pieces = [_Piece(flat[a:b], out[a:b]) for a, b in bounds]
    layouts = [chunk_layout(b - a, world) for a, b in bounds]
    failure = _Failure(pieces)
    thread = threading.Thread(target=_exchange_thread, args=(pieces, exchange, failure),
                              name="tb-compress-exchange", daemon=True)

    def encode(k: int) -> None:
        p = pieces[k]
        p.sent = encode_inputs(p.flat, layouts[k], codec)
        p.received = torch.empty_like(p.sent)
        p.ready["a2a"].set()

    def reduce(k: int) -> None:
        p = pieces[k]
        failure.wait(p.done["a2a"])
        p.mine = reduce_shard(p.received, layouts[k], codec)
        p.gathered = torch.empty(world, p.mine.shape[1], dtype=torch.uint8)
        p.ready["ag"].set()

    def decode(k: int) -> None:
        p = pieces[k]
        failure.wait(p.done["ag"])
        result = decode_result(p.gathered, layouts[k], codec, out=p.out)
        if result is not p.out:
            p.out.copy_(result)

    steps: list[Callable[[], None]] = []
    for k in range(min(2, len(pieces))):
        steps.append(lambda k=k: encode(k))
    for k in range(len(pieces)):
        steps.append(lambda k=k: reduce(k))
        if k + 2 < len(pieces):
            steps.append(lambda k=k: encode(k + 2))
        if k >= 1:
            steps.append(lambda k=k: decode(k - 1))
    steps.append(lambda: decode(len(pieces) - 1))

    thread.start()
    try:
        for step in steps:
            step()
    except BaseException as exc:
        failure.set(exc)
        raise
    finally:
        thread.join()
    if failure.error is not None:
        raise failure.error
