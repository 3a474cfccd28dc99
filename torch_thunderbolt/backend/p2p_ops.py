"""Point-to-point calls of the torch ProcessGroup. They do not go through the worker thread: the
message is posted at once, and the thread that waits on the work drives the transport."""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch

from ..algorithms.plan import tensor_bytes
from ..transport.base import ANY_SOURCE
from .tensors import Staged, flat_cat, on_device, split_into
from .host import GroupHost
from .work import Work


class PointToPointOps(GroupHost):
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        flat = flat_cat(tensors)
        req = self._transport.isend_p2p(dst, tag, tensor_bytes(flat))
        return self._p2p_work("send to", dst, tag, req, tensors, keep=flat)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        return self._recv(tensors, ANY_SOURCE, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        if len(tensors) == 1:
            staged = Staged(tensors[0], read=False)
            flat, done = staged.flat, (staged.write_back if staged.copied else None)
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
            done = functools.partial(split_into, flat, tensors)
        req = self._transport.irecv_p2p(src, tag, tensor_bytes(flat))
        return self._p2p_work("recv from", src, tag, req, tensors, keep=flat, on_done=done)

    def _p2p_work(self, verb: str, peer: int, tag: int, req: Any, result: Any, keep: Any,
                  on_done: Callable[[], None] | None = None) -> Work:
        who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        what = f"{verb} {who} (tag {tag}) on rank {self._rank}"

        def wait_fn(work: Work, seconds: float | None) -> None:
            budget = seconds if seconds is not None else self._timeout
            try:
                self._transport.wait([req], time.monotonic() + budget, what)
            except BaseException as exc:
                # The receive is still posted (a timeout) or the stream is out of step (a size mismatch): a
                # later message would be written into this buffer after the caller gave up on it. BROKEN
                # instead, as for a collective, and peers are told why.
                self._transport.abort(exc)
                raise
            _ = keep  # the buffer must stay alive until the transfer is done
            if on_done is not None:
                on_done()
            work._source = req.source
            work.finish()

        work = Work(what, result, wait_fn)
        work.device = on_device(result)
        if req.done and req.error is None:
            wait_fn(work, None)
        return work
