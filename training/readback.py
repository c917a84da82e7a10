"""A step's scalars read back to the host without waiting for the work queued after them.

    rb = Readback([loss, grad_norm])    # 0-d tensors on one device, at the end of step i
    ...                                 # step i + 1's forward and backward are queued
    loss_value, norm_value = rb.read()  # waits until the device has reached the end of step i, no further

`tensor.item()` on a CUDA tensor queues its copy behind everything already queued and waits for all of it: read
after the next step's forward and backward were queued, it waits for those too, and the GPU then idles while
the host queues the optimizer step and the next forward. Here the copy goes to pinned host memory as soon as
the values exist and a CUDA event marks that point in the stream; read() waits for the event only. On other
devices the values are copied at once.
"""
from __future__ import annotations

import torch


class Readback:
    def __init__(self, values: list[torch.Tensor]):
        stacked = torch.stack([v.detach().float().reshape(()) for v in values])  # (n,)
        if stacked.is_cuda:
            self.host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()  # on the current stream, behind the copy
        else:
            self.host, self.event = stacked.cpu(), None

    def read(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
