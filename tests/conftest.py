"""Shared pytest setup. Kept minimal; other modules may append fixtures below."""
import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter, which must be on before any kernel module
    # decorates its kernels (i.e. before anything imports kernels.flash_attention).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "autotune: run the kernel with its autotuner on (GPU only)")
