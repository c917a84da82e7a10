"""The training data path of train.py: the loader of a prepared folder, and its micro-batches on the device.

bench/train.py measures its step through these same functions, so that what it times is what training runs.
"""
from __future__ import annotations

import torch

from .chat_data import ChatData
from .loader import TokenData
from .sharded_loader import ShardedData


def open_train_data(folder: str, block_size: int, *, sharded: bool, seed: int,
                    device: torch.device | str, chat: bool = False) -> TokenData | ShardedData:
    """The loader of a prepared folder: ShardedData for token shards (data.format = "shards"), ChatData for
    conversations ("chat") or TokenData for train.bin / val.bin ("bin"), its batches in pinned host memory when
    `device` is a CUDA device."""
    pin = torch.device(device).type == "cuda"
    if sharded:
        return ShardedData(folder, block_size, seed=seed, pin_memory=pin)
    if chat:
        return ChatData(folder, block_size, seed=seed, pin_memory=pin)
    return TokenData(folder, block_size, seed=seed, pin_memory=pin)


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's inputs and targets (B, T) on `device`, copied with non_blocking=True: from pinned host
    memory the host goes on queueing work while the copies run; from pageable memory CUDA stages the bytes
    before the call returns, so the host waits for that part (open_train_data's loaders pin on a GPU)."""
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
