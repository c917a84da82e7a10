"""The process group of a run under torchrun: opened from torchrun's environment, closed after a barrier."""
from __future__ import annotations

import os

import torch


def setup_distributed(device: str = "auto"):
    """(rank, local_rank, world_size); initialises the process group under torchrun: NCCL when the run trains on
    CUDA, gloo when it trains on the CPU (train.device = "cpu", or no GPU), whatever the machine has."""
    if "RANK" not in os.environ:
        return 0, 0, 1
    import torch.distributed as dist
    backend = "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    return dist.get_rank(), local_rank, dist.get_world_size()


def teardown_distributed(world: int) -> None:
    """Close the process group once every rank has reached the end (a barrier first), so that no rank closes
    its connections while another still communicates: a 4-rank gloo run on 2 CPU cores once ended with one rank
    aborted at exit ("terminate called without an active exception") after training had finished."""
    if world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
