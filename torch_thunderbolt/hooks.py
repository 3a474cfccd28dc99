"""DDP communication hooks: int8 (with error feedback), fp16 and bf16 gradient all-reduce.

    state = CompressionState()                       # after init_process_group, on every rank
    model = DistributedDataParallel(model)
    model.register_comm_hook(state, int8_hook)       # or fp16_hook / bf16_hook

Gradients are averaged (divided by the world size, then summed through the compressed all-reduce of
`torch_thunderbolt.compression`). Unlike torch's fp16/bf16 hooks the sum is taken in fp32, so the
error does not grow with the number of ranks' roundings. Works on any backend that has
all_to_all_single and all_gather_single (gloo, thunderbolt).

A bucket on the CPU gets the result written in place (the future's value is the bucket). For a bucket on a
device (mps) the future's value is the averaged gradient in host memory, which DDP copies into `.grad` in
autograd's thread: no device op runs in the thread that finishes the exchange, and the exchange overlaps
the rest of the backward pass.
"""

from typing import Optional

import torch
import torch.distributed as dist

from .compression.codecs import Codec, codec_for
from .compression.scheme import DEFAULT_BLOCK_SIZE, check_block_size, chunk_layout
from .compression.pipeline import AsyncGroups, Residuals, all_reduce_future, completed_future, make_phase2_group

__all__ = ["CompressionState", "int8_hook", "fp16_hook", "bf16_hook"]

# DDP compares the hook's annotations with these exact objects, so this module must not use
# `from __future__ import annotations` (string annotations fail register_comm_hook).


class CompressionState:
    """Hook state: the group, the int8 block size, and the error-feedback residuals per bucket.

    Construct it on every rank at the same point after init_process_group: it creates a private
    process group (same ranks and backend) for the second phase of each all-reduce.
    With `error_feedback`, what int8 rounding drops from a bucket is added to that bucket's next
    gradient (keyed by bucket index; reset when a bucket changes size, e.g. when DDP rebuilds buckets).
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        error_feedback: bool = True,
    ) -> None:
        self.process_group = process_group
        self.block_size = check_block_size(block_size)
        self.error_feedback = bool(error_feedback)
        self.residuals: dict[int, Residuals] = {}
        self._groups: Optional[AsyncGroups] = None
        if dist.is_initialized():
            self._groups = self._make_groups()

    def _make_groups(self) -> AsyncGroups:
        return AsyncGroups(self.process_group, make_phase2_group(self.process_group))

    @property
    def groups(self) -> AsyncGroups:
        if self._groups is None:  # state built before init_process_group: build on first hook call
            self._groups = self._make_groups()
        return self._groups

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def residuals_for(self, index: int, numel: int) -> Residuals:
        """The bucket's residuals, zeroed when new or when the bucket's size changed."""
        held = self.residuals.get(index)
        shard = chunk_layout(numel, self.world_size).shard
        if held is None or held.local.numel() != numel:
            held = Residuals(torch.zeros(numel), torch.zeros(shard))
            self.residuals[index] = held
        return held

    def reset(self) -> None:
        """Forget all residuals (e.g. after loading a checkpoint)."""
        self.residuals.clear()


def _compressed_hook(
    state: CompressionState, bucket: dist.GradBucket, codec: Codec, feedback: bool
) -> torch.futures.Future:
    buffer = bucket.buffer()
    world = state.world_size
    if world == 1 or buffer.numel() == 0:
        return completed_future(buffer)
    # Divide first, like torch's hooks: fp16 then overflows only if the mean gradient does. The codecs,
    # the residuals and both phases work on a CPU copy: a bucket on another device (mps) is read here, in
    # the thread DDP calls the hook from.
    flat = buffer.detach().reshape(-1).to("cpu", torch.float32).div_(world)
    residuals = state.residuals_for(bucket.index(), buffer.numel()) if feedback else None
    reduced = all_reduce_future(flat, codec, state.groups, residuals)

    if not buffer.is_cpu:
        # A bucket on a device (mps): the averaged gradient stays in host memory and DDP copies it into
        # .grad itself, in autograd's thread. Writing it into the bucket here would be a device op in
        # whichever thread completes the exchange (a backend thread; Metal encoding from two threads at
        # once crashes the process), and the whole exchange overlaps the rest of the backward pass.
        return reduced

    def write_back(fut: torch.futures.Future) -> torch.Tensor:
        # In place into the bucket, as torch's hooks do, to avoid a second bucket-sized buffer.
        buffer.copy_(fut.value().view(buffer.shape))
        return buffer

    return reduced.then(write_back)


def int8_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average gradients through block-absmax int8 (1 byte/element + 4 bytes per block on the wire)."""
    return _compressed_hook(state, bucket, codec_for("int8", state.block_size), state.error_feedback)


def fp16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average gradients through fp16 (2 bytes/element), summed in fp32."""
    return _compressed_hook(state, bucket, codec_for("fp16"), False)


def bf16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average gradients through bf16 (2 bytes/element), summed in fp32."""
    return _compressed_hook(state, bucket, codec_for("bf16"), False)
