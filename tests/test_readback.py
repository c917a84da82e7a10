"""training/readback.py: a step's scalars read back as they were when queued, without waiting for later work."""
import math

import pytest
import torch

from training.readback import Readback


def test_values_as_they_were_when_read_back_was_made():
    loss, norm = torch.tensor(2.5), torch.tensor(float("inf"))
    rb = Readback([loss, norm, torch.zeros((), dtype=torch.float64)])
    loss.add_(1.0)  # later work on the same tensors does not reach the copy
    values = rb.read()
    assert values[0] == 2.5 and math.isinf(values[1]) and values[2] == 0.0
    assert all(isinstance(v, float) for v in values)


def test_nan_and_integer_inputs():
    values = Readback([torch.tensor(float("nan")), torch.tensor(3)]).read()
    assert math.isnan(values[0]) and values[1] == 3.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_read_waits_for_its_point_in_the_stream_only():
    """The copy goes to pinned memory behind the values; work queued after it (a long matmul chain here) does
    not change what is read, and the values are right even when read while that work still runs."""
    x = torch.randn(4096, 4096, device="cuda")
    loss = (x * 0 + 7.0).sum() / x.numel()  # 7.0, on the device
    norm = torch.linalg.vector_norm(torch.full((16,), 0.5, device="cuda"))  # 2.0
    rb = Readback([loss, norm])
    assert rb.host.is_pinned()
    y = x
    for _ in range(20):  # keeps the GPU busy after the read-back point
        y = y @ x
        y = y / y.abs().max()
    loss.add_(100.0)  # queued after the copy: not seen
    assert rb.read() == pytest.approx([7.0, 2.0])
    torch.cuda.synchronize()
