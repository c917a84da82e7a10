"""Shared pytest setup. Kept minimal; other modules may append fixtures below."""
import os
import sys

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only through the interpreter, which must be on before any kernel module
    # decorates its kernels (i.e. before anything imports kernels.flash).
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The entry points the tests start as subprocesses take each kernel's default tile config: autotuning every
# config on first use costs tens of seconds of compiling per process on a GPU (tests marked `autotune` turn it
# on for themselves, in this process; see _kernel_options below).
os.environ.setdefault("FLASHGPT_AUTOTUNE", "0")


def pytest_addoption(parser):
    parser.addoption("--test-times", metavar="PATH", default=None,
                     help="append one line per test phase to PATH as it ends (seconds, phase, outcome, worker, "
                          "test id, tab-separated): the durations survive a run stopped at its limit")
    parser.addoption("--failure-log", metavar="PATH", default=None,
                     help="append each failed test phase's report (id, worker, traceback) to PATH as it ends: the "
                          "reasons survive a run stopped before pytest's summary")
    parser.addoption("--gpu-memory", metavar="PATH", default=None,
                     help="append one line per test that used the GPU to PATH as it ends (its peak of GPU memory "
                          "reserved in GiB, worker, test id, tab-separated)")


def _kernels_name_clash() -> str | None:
    """One line when the installed transformers cannot build a model next to this checkout, else None: releases
    from 5.25 import Hugging Face's `kernels` package, and this project's `kernels/` answers that import."""
    import importlib.metadata
    try:
        importlib.metadata.version("kernels")  # Hugging Face's package; absent: transformers never imports it
        import transformers.integrations.hub_kernels  # noqa: F401
    except importlib.metadata.PackageNotFoundError:
        return None
    except ImportError as e:
        if "'kernels'" not in str(e):
            return None  # transformers absent or broken otherwise: the tests that need it say so
        import transformers
        return (f"transformers {transformers.__version__} imports Hugging Face's `kernels` package, which this "
                "checkout's kernels/ shadows: pip install 'transformers<5.25' (the dev extra's pin)")
    return None


def pytest_configure(config):
    if not hasattr(config, "workerinput") and (clash := _kernels_name_clash()):
        raise pytest.UsageError(clash)
    config.addinivalue_line("markers", "autotune: run the kernel with its autotuner on (GPU only)")
    config.addinivalue_line("markers", "slow: an exhaustive sweep, skipped unless selected with `-m slow`")
    if hasattr(config, "workerinput"):  # an xdist worker: its share of the cores, for itself and what it starts
        threads = max(1, (os.cpu_count() or 1) // int(config.workerinput.get("workercount", 1)))
        torch.set_num_threads(threads)
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(key, str(threads))
    if not hasattr(config, "workerinput"):  # the controller writes (xdist workers send it their reports)
        if path := config.getoption("--test-times"):
            config.pluginmanager.register(_TestTimes(path), "flashgpt-test-times")
        if path := config.getoption("--failure-log"):
            config.pluginmanager.register(_FailureLog(path), "flashgpt-failure-log")
        if path := config.getoption("--gpu-memory"):
            config.pluginmanager.register(_GpuMemoryLog(path), "flashgpt-gpu-memory")


def _worker(report) -> str:
    return getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "-")


class _TestTimes:
    """Writes each test phase's duration as it ends, flushed line by line."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)

    def pytest_runtest_logreport(self, report):
        self.file.write(f"{report.duration:.3f}\t{report.when}\t{report.outcome}\t{_worker(report)}\t{report.nodeid}\n")

    def pytest_unconfigure(self, config):
        self.file.close()


class _FailureLog:
    """Appends each failed phase's report as it ends (a header line, then pytest's text of the failure)."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.failed:
            _append_failure(self.path, report.nodeid, report.when, _worker(report), report.longreprtext)


def _append_failure(path: str, test: str, what: str, worker: str, text: str) -> None:
    """One entry of a --failure-log file: a header line (test id, what failed, worker, time), then the text."""
    import time
    with open(path, "a") as f:
        f.write(f"=== {test} ({what}, worker {worker}, {time.strftime('%H:%M:%S')})\n{text}\n\n")


class _GpuMemoryLog:
    """Appends each test's peak of reserved GPU memory (the _gpu_memory_given_back fixture records it) as the
    test ends."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)

    def pytest_runtest_logreport(self, report):
        peak = dict(report.user_properties).get(GPU_PEAK)
        if report.when == "teardown" and peak is not None:
            self.file.write(f"{peak / 2**30:.2f}\t{_worker(report)}\t{report.nodeid}\n")

    def pytest_unconfigure(self, config):
        self.file.close()


def pytest_collection_modifyitems(config, items):
    """`slow` tests run only when the -m expression names them (`-m slow`, `-m "slow or not slow"`). On a GPU the
    tests start longest first (see _longest_first)."""
    if torch.cuda.is_available():
        _longest_first(items, DURATIONS)
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow sweep: select it with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


DURATIONS = os.path.join(os.path.dirname(__file__), "gpu_durations.tsv")


def _longest_first(items, path: str) -> None:
    """Order `items` by their seconds in `path` (tab-separated seconds and test id, one per line), longest first;
    a test the file does not list counts as the median of those it does. With pytest-xdist handing tests out in
    this order, the minute-long tests start at the beginning on all workers instead of wherever collection put
    them, so the run does not end with one worker finishing a long test alone. Only the order changes: every
    test still runs. Without the file the order stays as collected."""
    try:
        with open(path) as f:
            rows = [line.rstrip("\n").split("\t", 1) for line in f if line.strip() and not line.startswith("#")]
        seconds = {test: float(s) for s, test in rows}
    except FileNotFoundError:
        return
    known = sorted(seconds.values())
    default = known[len(known) // 2] if known else 0.0
    items.sort(key=lambda item: -seconds.get(item.nodeid, default))  # stable: ties keep the collected order


# Offline and quiet: hub lookups fail fast instead of retrying, wandb and tiktoken write under the
# test's temporary folders, progress bars stay out of the logs.
for _key, _value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                     "WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
    os.environ.setdefault(_key, _value)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _kernel_options(request):
    """Every test starts from the default kernel options, autotuning only in tests marked `autotune`."""
    from kernels import options
    with options.use(autotune="autotune" in request.keywords):
        yield


def _gpu_used() -> bool:
    """Whether this process has used CUDA (a test process that never did has nothing on the GPU to check)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_context_broken() -> str | None:
    """None while this process's CUDA context still runs work (or CUDA was never used in it), else the error's
    first line. After an illegal address, a device-side assert or a failed library call such as cuBLAS's
    "unknown error", every later CUDA call of the process fails."""
    if not _gpu_used():
        return None
    try:
        torch.cuda.synchronize()
        if (torch.ones(1, device="cuda") + 1).item() != 2.0:
            return "1 + 1 on the GPU did not give 2"
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    return None


CONTEXT_BROKEN_EXIT = 3


@pytest.fixture(autouse=True)
def _cuda_context_checked(request):
    """After each test, whether the process can still use the GPU. If not, one line names the test after which
    it broke and the error (in the --failure-log file too), and the process stops: a pytest-xdist worker exits
    and xdist starts a fresh one for the remaining tests (the test it was running is reported as crashed); a
    plain run ends. Otherwise each later test of the process would fail with the same error."""
    yield
    error = _cuda_context_broken()
    if error is None:
        return
    message = f"CUDA context broken after {request.node.nodeid}: {error}"
    worker = getattr(request.config, "workerinput", {}).get("workerid")
    if path := request.config.getoption("--failure-log"):
        _append_failure(path, request.node.nodeid, "CUDA context broken", worker or "-", error)
    if worker is None:
        pytest.exit(message, returncode=CONTEXT_BROKEN_EXIT)
    sys.stderr.write(f"\n{message}: worker {worker} exits, pytest-xdist starts a fresh one\n")
    sys.stderr.flush()
    os._exit(CONTEXT_BROKEN_EXIT)


GPU_PEAK = "gpu_peak_reserved_bytes"
GIVE_BACK_BYTES = 1 << 30


@pytest.fixture(autouse=True)
def _gpu_memory_given_back(request):
    """After a test that used the GPU: its peak of reserved memory goes in its report (--gpu-memory writes it),
    and the memory torch's allocator keeps cached beyond GIVE_BACK_BYTES goes back to the driver. The suite runs
    16 processes on one GPU: memory one test left cached is memory the others' tests cannot allocate."""
    yield
    if not _gpu_used():
        return
    request.node.user_properties.append((GPU_PEAK, torch.cuda.max_memory_reserved()))
    if torch.cuda.memory_reserved() > GIVE_BACK_BYTES:
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@pytest.fixture(autouse=True)
def _float32_matmul_precision():
    """Every test starts with torch's default float32 matmul precision and leaves it so: an entry point run in
    the test's process (bench/train.py's main turns TF32 on) would otherwise change later tests' float32
    references on a GPU."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


@pytest.fixture(autouse=True)
def _wandb_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
