"""train.py under faults: a second writer, stale locks and temp files, changed data or config on resume, a
finished run, SIGTERM (alone and under torchrun), a full or read-only disk, a torn metrics line."""
import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from training import runlog
import train as train_mod
import training.trainer as trainer_mod
from config import ConfigError, load_config
from model.checkpoint import load_checkpoint
from training.runfolder import LOCK_NAME, RunFolderError, RunLock, _proc_start, atomic_file
from tests.test_train import metrics
from tests.util import ROOT, TINY_MODEL, write_corpus


def args_for(tmp_path, *extra) -> list[str]:
    """A tiny CPU run of tmp_path/corpus.txt (written on first use) into tmp_path/run."""
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        write_corpus(tmp_path)
    return [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", f"--out_dir={tmp_path}/run", "--num_proc=1",
            "--batch_size=8", "--learning_rate=3e-3", "--min_lr=3e-4", "--warmup_iters=5", "--eval_iters=2",
            "--log_interval=1", "--device=cpu", *TINY_MODEL, *extra]


def cfg_for(tmp_path, *extra):
    return load_config(None, args_for(tmp_path, *extra))


def run_dir(tmp_path) -> str:
    return str(tmp_path / "run")


def steps_on_disk(folder) -> list[int]:
    return sorted(int(f[5:12]) for f in os.listdir(folder) if f.startswith("ckpt_"))


def temp_files(folder) -> list[str]:
    return [f for f in os.listdir(folder) if f.startswith(".tmp-")]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def one_error_line(err: str) -> bool:
    """stderr holds one error line and no traceback (a progress bar may share it in-process)."""
    return len(error_lines(err)) == 1 and "Traceback" not in err


ENV = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
           FLASHGPT_QUIET="1", OMP_NUM_THREADS="1")


def start_training(tmp_path, *extra, torchrun: int = 0) -> subprocess.Popen:
    """A long training run in a subprocess (as a user starts it), logging every step."""
    entry = [sys.executable, os.path.join(ROOT, "train.py")]
    if torchrun:
        entry = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                 os.path.join(ROOT, "train.py")]
    args = args_for(tmp_path, "--max_iters=100000", "--eval_interval=100000", "--max_time=0", *extra)
    return subprocess.Popen(entry + args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_steps(proc, folder, n: int = 1, timeout: float = 180) -> None:
    """Until `n` training steps are logged in metrics.jsonl."""
    path = os.path.join(folder, "metrics.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path) and sum('"loss"' in line for line in open(path)) >= n:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no training step was logged in time")


# ------------------------------------------------------------------------------------------ the run folder lock

def write_lock(folder, **holder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOCK_NAME), "w") as f:
        f.write(json.dumps(holder) + "\n")


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_lock_of_a_running_process_refuses_a_second_writer(tmp_path):
    write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname(), started="t0",
               proc_start=_proc_start(os.getpid()))
    with pytest.raises(RunFolderError) as e:
        RunLock(str(tmp_path)).__enter__()
    assert f"in use by {os.getpid()}@{socket.gethostname()}" in str(e.value) and "\n" not in str(e.value)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["started"] == "t0"  # untouched


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid, host=socket.gethostname(), started="t0", proc_start=None)
    with RunLock(str(tmp_path)) as lock:
        assert lock.took_over.startswith(f"{pid}@{socket.gethostname()}") and "no longer runs" in lock.took_over
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_a_reused_pid_is_taken_over(tmp_path):
    """The pid runs, but it is another process than the one that wrote the lock (its start time differs)."""
    if _proc_start(os.getpid()) is None:
        pytest.skip("no /proc start times here")
    write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname(), started="t0", proc_start="1")
    with RunLock(str(tmp_path)) as lock:
        assert lock.took_over


def test_lock_from_another_host_is_never_taken_over(tmp_path):
    write_lock(tmp_path, pid=dead_pid(), host="some-other-host", started="t0")
    with pytest.raises(RunFolderError) as e:
        RunLock(str(tmp_path)).__enter__()
    msg = str(e.value)
    assert "@some-other-host" in msg and f"delete {tmp_path / LOCK_NAME}" in msg and "\n" not in msg
    assert (tmp_path / LOCK_NAME).exists()


def test_unreadable_old_lock_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    old = time.time() - 60
    os.utime(tmp_path / LOCK_NAME, (old, old))
    with RunLock(str(tmp_path)) as lock:
        assert "unreadable" in lock.took_over


def test_lock_is_released_only_if_still_its_own(tmp_path):
    lock = RunLock(str(tmp_path)).__enter__()
    write_lock(tmp_path, pid=12345, host="elsewhere", started="t1")  # replaced behind its back
    lock.__exit__(None, None, None)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "elsewhere"


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    """A failed write leaves the old file and no temporary one; a finished one has the umask's permissions (as
    open() gives), not a private temp file's 0600."""
    path = tmp_path / "report.md"
    path.write_text("old")
    with pytest.raises(OSError, match="No space left"):
        with atomic_file(str(path)) as f:
            f.write("half")
            raise os_error(errno.ENOSPC)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]
    umask = os.umask(0o022)
    try:
        with atomic_file(str(path), "wb") as f:
            f.write(b"new")
    finally:
        os.umask(umask)
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["report.md"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_run_holds_the_lock_and_releases_it_on_every_exit(tmp_path, monkeypatch):
    seen = []
    real = trainer_mod.estimate_loss

    def spy(*a, **k):
        seen.append(json.loads(open(os.path.join(run_dir(tmp_path), LOCK_NAME)).read()))
        return real(*a, **k)

    monkeypatch.setattr(trainer_mod, "estimate_loss", spy)
    train_mod.train(cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2"))
    assert seen and all(h["pid"] == os.getpid() and h["host"] == socket.gethostname() for h in seen)
    assert not os.path.exists(os.path.join(run_dir(tmp_path), LOCK_NAME))  # normal end
    with pytest.raises(train_mod.TrainError, match="already holds checkpoints"):
        train_mod.train(cfg_for(tmp_path, "--max_iters=2"))
    assert not os.path.exists(os.path.join(run_dir(tmp_path), LOCK_NAME))  # error
    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(trainer_mod, "prepare", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(train_mod.Interrupted):  # a signal during setup stops at once
        train_mod.train(cfg_for(tmp_path / "b", "--max_iters=2"))
    assert not os.path.exists(os.path.join(run_dir(tmp_path / "b"), LOCK_NAME))  # signal
    assert signal.getsignal(signal.SIGTERM) is handler  # restored


def test_two_runs_into_one_out_dir_the_second_is_refused(tmp_path, capsys):
    """A runs; B into the same folder is refused naming A; after kill -9 of A, B takes the stale lock over."""
    proc = start_training(tmp_path)
    try:
        wait_for_steps(proc, run_dir(tmp_path))
        rc = train_mod.main(args_for(tmp_path, "--max_iters=5"))
        err = capsys.readouterr().err
        assert rc == 1 and one_error_line(err)
        assert f"in use by {proc.pid}@{socket.gethostname()}" in err
        rc = train_mod.main(args_for(tmp_path, "--max_iters=5"))  # --resume, too
        assert rc == 1 and f"{proc.pid}@" in capsys.readouterr().err
    finally:
        proc.kill()
        proc.communicate()
    rc = train_mod.main(args_for(tmp_path, "--max_iters=3") + ["--resume"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"took over the lock left by {proc.pid}@{socket.gethostname()}" in err
    assert not os.path.exists(os.path.join(run_dir(tmp_path), LOCK_NAME))


# ------------------------------------------------------------------------------------------------ temp files

def test_stale_temp_files_are_removed_at_start_and_resume(tmp_path, capsys):
    folder = run_dir(tmp_path)
    os.makedirs(folder)
    (tmp_path / "run" / ".tmp-abc.pt").write_bytes(b"x" * 3000)  # a checkpoint write killed with -9
    train_mod.train(cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2"))
    assert "removed 1 temporary file(s) (2.9 KiB)" in capsys.readouterr().err
    (tmp_path / "run" / ".tmp-def.pt").write_bytes(b"x" * 2048)
    (tmp_path / "run" / ".tmp-ghi.png").write_bytes(b"x" * 1024)
    train_mod.train(cfg_for(tmp_path, "--max_iters=3", "--eval_interval=2", "--init_from=resume"))
    assert "removed 2 temporary file(s) (3.0 KiB)" in capsys.readouterr().err
    assert temp_files(folder) == []
    assert load_checkpoint(folder)["iter"] == 3


# ---------------------------------------------------------------------------------------- resume integrity

def test_resume_after_the_char_corpus_changed_is_refused(tmp_path):
    cfg = cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2")
    train_mod.train(cfg)
    corpus = cfg.data.dataset
    text = open(corpus).read()
    with open(corpus, "w") as f:  # the same file, now without two of its letters
        f.write(text.replace("q", "").replace("w", ""))
    later = time.time() + 10
    os.utime(corpus, (later, later))
    before = open(os.path.join(run_dir(tmp_path), "config.toml")).read()
    with pytest.raises(train_mod.TrainError) as e:
        train_mod.train(cfg_for(tmp_path, "--max_iters=4", "--init_from=resume"))
    msg = str(e.value)
    old_n = len(load_checkpoint(run_dir(tmp_path))["tokenizer"]["chars"])
    assert f"alphabet has {old_n - 2} characters, the checkpoint's {old_n}" in msg and "gone: 'qw'" in msg
    assert "\n" not in msg
    assert open(os.path.join(run_dir(tmp_path), "config.toml")).read() == before
    assert load_checkpoint(run_dir(tmp_path))["iter"] == 2


def test_resume_with_a_model_override_is_refused_unless_allowed(tmp_path, capsys):
    train_mod.train(cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2"))
    capsys.readouterr()
    rc = train_mod.main(args_for(tmp_path, "--max_iters=4", "--n_layer=8") + ["--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: --resume: ")
    assert "model.n_layer=8 (--n_layer=8) against the checkpoint's 2" in err and "--allow-config-change" in err
    # allowed, a change that keeps the weights' shapes is applied; one that does not is refused
    rc = train_mod.main(args_for(tmp_path, "--max_iters=4", "--n_layer=8") + ["--resume", "--allow-config-change"])
    err = capsys.readouterr().err
    assert rc == 1 and "do not fit" in error_lines(err)[0]
    rc = train_mod.main(args_for(tmp_path, "--max_iters=4", "--dropout=0.25", "--learning_rate=1e-3")
                        + ["--resume", "--allow-config-change"])
    assert rc == 0, capsys.readouterr().err
    ckpt = load_checkpoint(run_dir(tmp_path))
    assert ckpt["iter"] == 4 and ckpt["config"]["model"]["dropout"] == 0.25
    assert ckpt["config"]["train"]["learning_rate"] == 1e-3  # [train] keys change freely, as before


def test_resume_with_another_dataset_is_refused(tmp_path):
    train_mod.train(cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2"))
    other = write_corpus(tmp_path / "other", seed=1)
    with pytest.raises(ConfigError) as e:
        train_mod.train(cfg_for(tmp_path, "--max_iters=4", "--init_from=resume", f"--dataset={other}"))
    assert f"data.dataset={other!r} (--dataset={other})" in str(e.value)
    assert load_checkpoint(run_dir(tmp_path))["iter"] == 2


def test_resume_with_a_contradicting_config_file_is_refused(tmp_path, capsys):
    train_mod.train(cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2"))
    toml = tmp_path / "edited.toml"
    toml.write_text("[model]\nn_embd = 64\n")
    rc = train_mod.main([str(toml)] + args_for(tmp_path, "--max_iters=3") + ["--resume"])
    assert rc == 0, capsys.readouterr().err  # the flag --n_embd=32, given after the file, matches the checkpoint
    toml.write_text("[data]\nval_fraction = 0.2\n")
    capsys.readouterr()
    rc = train_mod.main([str(toml)] + args_for(tmp_path, "--max_iters=4") + ["--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: --resume: ")
    assert f"data.val_fraction=0.2 ({toml}) against the checkpoint's 0.1" in err
    # the run's own config.toml always resumes it
    rc = train_mod.main([os.path.join(run_dir(tmp_path), "config.toml"), "--max_iters=4", "--resume"])
    assert rc == 0, capsys.readouterr().err
    assert load_checkpoint(run_dir(tmp_path))["iter"] == 4


# -------------------------------------------------------------------------------------------- finished runs

def test_resume_on_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    train_mod.train(cfg_for(tmp_path, "--max_iters=3", "--eval_interval=3"))
    folder = run_dir(tmp_path)
    before = {f: (os.path.getmtime(os.path.join(folder, f)), open(os.path.join(folder, f), "rb").read())
              for f in os.listdir(folder)}
    capsys.readouterr()
    rc = train_mod.main(args_for(tmp_path, "--max_iters=3") + ["--resume"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    assert "already finished" in out and "step 3" in out and len(out.strip().splitlines()) == 1
    after = {f: (os.path.getmtime(os.path.join(folder, f)), open(os.path.join(folder, f), "rb").read())
             for f in os.listdir(folder)}
    assert after == before


def test_resume_with_a_lower_max_iters_is_refused(tmp_path, capsys):
    train_mod.train(cfg_for(tmp_path, "--max_iters=4", "--eval_interval=4"))
    config_toml = open(os.path.join(run_dir(tmp_path), "config.toml")).read()
    capsys.readouterr()
    rc = train_mod.main(args_for(tmp_path, "--max_iters=2") + ["--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "train.max_iters=2 is below" in err and "step 4" in err
    assert open(os.path.join(run_dir(tmp_path), "config.toml")).read() == config_toml
    assert "max_iters = 4" in config_toml


# ------------------------------------------------------------------------------------------------- signals

def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path):
    proc = start_training(tmp_path)
    wait_for_steps(proc, run_dir(tmp_path))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert error_lines(err) == err.strip().splitlines()[-1:] and "Traceback" not in err
    assert "interrupted at step" in err and "(SIGTERM)" in err and "--resume" in err
    folder = run_dir(tmp_path)
    ckpt = load_checkpoint(folder)
    assert ckpt["iter"] >= 1 and f"ckpt_{ckpt['iter']:07d}.pt" in err
    assert not os.path.exists(os.path.join(folder, LOCK_NAME)) and temp_files(folder) == []
    train_mod.train(cfg_for(tmp_path, f"--max_iters={ckpt['iter'] + 2}", "--eval_interval=100000",
                            "--max_time=0", "--init_from=resume"))
    assert load_checkpoint(folder)["iter"] == ckpt["iter"] + 2


def test_sigterm_never_saves_a_non_finite_step(tmp_path, monkeypatch):
    """SIGTERM arrives during step 6, whose loss is NaN and not read back yet (log_interval 10): the run stops
    on the NaN, and no checkpoint holds that step's weights."""
    from model import GPT
    real, calls = GPT.forward, {"n": 0}

    def poisoned(self, idx, targets=None, input_pos=None):
        logits, loss = real(self, idx, targets, input_pos)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 7:  # step 6
                os.kill(os.getpid(), signal.SIGTERM)
            if calls["n"] >= 7:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    cfg = cfg_for(tmp_path, "--max_iters=30", "--eval_interval=100", "--log_interval=10")
    with pytest.raises(train_mod.TrainError, match=r"non-finite loss .* step 6:"):
        train_mod.train(cfg)
    assert steps_on_disk(run_dir(tmp_path)) == [0]


def test_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod.StopSignals, "repeat_after_s", 0.0)
    from model import GPT
    real, calls = GPT.forward, {"n": 0}

    def forward(self, idx, targets=None, input_pos=None):
        if self.training:
            calls["n"] += 1
            if calls["n"] == 4:
                os.kill(os.getpid(), signal.SIGINT)  # asks to stop after this step
                os.kill(os.getpid(), signal.SIGINT)  # impatient: stops now
        return real(self, idx, targets, input_pos)

    monkeypatch.setattr(GPT, "forward", forward)
    with pytest.raises(train_mod.Stopped, match="interrupted again at step 3 .*without a checkpoint"):
        train_mod.train(cfg_for(tmp_path, "--max_iters=30", "--eval_interval=100"))
    assert steps_on_disk(run_dir(tmp_path)) == [0]


def test_ctrl_c_pressed_twice_at_once_still_saves(tmp_path, monkeypatch):
    """Two SIGINTs within repeat_after_s (a double key press, or torchrun passing on the terminal's) count
    as one: the run stops after the step in flight and saves it."""
    from model import GPT
    real, calls = GPT.forward, {"n": 0}

    def forward(self, idx, targets=None, input_pos=None):
        if self.training:
            calls["n"] += 1
            if calls["n"] == 4:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
        return real(self, idx, targets, input_pos)

    monkeypatch.setattr(GPT, "forward", forward)
    with pytest.raises(train_mod.Stopped, match=r"interrupted at step 4 \(SIGINT\); checkpoint saved"):
        train_mod.train(cfg_for(tmp_path, "--max_iters=30", "--eval_interval=100"))
    assert steps_on_disk(run_dir(tmp_path)) == [0, 4] and load_checkpoint(run_dir(tmp_path))["iter"] == 4


def worker_pids(pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (its children with RANK in their environment)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in open(f"/proc/{pid}/task/{task}/children").read().split():
            env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
            ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
            if ranks:
                out[ranks[0]] = int(child)
    return out


@pytest.mark.parametrize("target", ["torchrun", "rank 1 only"])
def test_sigterm_under_torchrun_saves_once_and_stops_every_rank(target, tmp_path):
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        pytest.skip("needs /proc/<pid>/task/<tid>/children")
    proc = start_training(tmp_path, "--batch_size=4", "--attention=naive", torchrun=2)
    folder = run_dir(tmp_path)
    wait_for_steps(proc, folder, n=2)
    if target == "torchrun":
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to every rank
    else:
        os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)  # rank 0 learns it through the step's all-reduce
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    said = [line for line in err.splitlines() if "interrupted at step" in line]
    assert len(said) == 1, err[-3000:]  # rank 0 only
    ckpt = load_checkpoint(folder)
    assert ckpt["iter"] >= 2 and f"ckpt_{ckpt['iter']:07d}.pt" in said[0]
    assert ("(SIGTERM)" if target == "torchrun" else "a signal to another rank") in said[0]
    assert steps_on_disk(folder) == [0, ckpt["iter"]] and temp_files(folder) == []
    assert not os.path.exists(os.path.join(folder, LOCK_NAME))


# ------------------------------------------------------------------------------------ full or read-only disk

def os_error(code: int, filename=None) -> OSError:
    return OSError(code, os.strerror(code), filename)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_disk_full_while_writing_a_checkpoint(code, tmp_path, monkeypatch, capsys):
    real, calls = torch.save, {"n": 0}

    def save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            f.write(b"partial")
            raise os_error(code)
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    rc = train_mod.main(args_for(tmp_path, "--max_iters=10", "--eval_interval=5"))
    err = capsys.readouterr().err
    folder = run_dir(tmp_path)
    assert rc == 1 and one_error_line(err)
    assert f"could not write {os.path.join(folder, 'ckpt_0000005.pt')} ({os.strerror(code)})" in err
    assert f"last whole checkpoint is {os.path.join(folder, 'ckpt_0000000.pt')}" in err
    monkeypatch.undo()
    assert load_checkpoint(folder)["iter"] == 0 and temp_files(folder) == []


def test_disk_full_while_writing_best_pt(tmp_path, monkeypatch):
    real, calls = os.replace, {"n": 0}

    def replace(src, dst, *a, **k):
        if os.path.basename(dst) == "best.pt":
            calls["n"] += 1
            if calls["n"] == 2:
                raise os_error(errno.ENOSPC, src)
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    cfg = cfg_for(tmp_path, "--max_iters=40", "--eval_interval=5")
    with pytest.raises(train_mod.TrainError) as e:
        train_mod.train(cfg)
    folder = run_dir(tmp_path)
    assert f"could not write {os.path.join(folder, 'best.pt')} (No space left on device)" in str(e.value)
    monkeypatch.undo()
    last = steps_on_disk(folder)[-1]
    assert last >= 5 and f"last whole checkpoint is {os.path.join(folder, f'ckpt_{last:07d}.pt')}" in str(e.value)
    assert load_checkpoint(folder)["iter"] == last
    assert load_checkpoint(os.path.join(folder, "best.pt"))["iter"] < last  # the previous best.pt, whole


def test_disk_full_while_writing_the_plot_is_a_warning(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    def savefig(self, f, *a, **k):
        f.write(b"\x89PNG partial")
        raise os_error(errno.ENOSPC)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    summary = train_mod.train(cfg_for(tmp_path, "--max_iters=4", "--eval_interval=2"))
    err = capsys.readouterr().err
    folder = run_dir(tmp_path)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3 and f"could not write {os.path.join(folder, 'loss.png')}" in warnings[0]
    assert "No space left on device" in warnings[0] and "training continues" in warnings[0]
    assert summary["iters"] == 4 and load_checkpoint(folder)["iter"] == 4
    assert temp_files(folder) == [] and not os.path.exists(os.path.join(folder, "loss.png"))


class TornWrite:
    """A file whose write stores half the text, then fails as a full or read-only disk does."""

    def __init__(self, f, code):
        self.f, self.code = f, code

    def write(self, text):
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise os_error(self.code)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_disk_full_while_appending_metrics_then_resume_drops_the_torn_line(code, tmp_path, monkeypatch, capsys):
    calls = {"n": 0}

    def fake_open(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        if mode == "a" and os.path.basename(path) == "metrics.jsonl":
            calls["n"] += 1
            if calls["n"] == 8:
                return TornWrite(f, code)
        return f

    monkeypatch.setattr(runlog, "open", fake_open, raising=False)
    rc = train_mod.main(args_for(tmp_path, "--max_iters=20", "--eval_interval=5"))
    err = capsys.readouterr().err
    folder = run_dir(tmp_path)
    assert rc == 1 and one_error_line(err)
    assert f"could not write {os.path.join(folder, 'metrics.jsonl')} ({os.strerror(code)})" in err
    assert "last whole checkpoint is" in err and load_checkpoint(folder)["iter"] == 5
    monkeypatch.undo()
    text = open(os.path.join(folder, "metrics.jsonl")).read()
    assert not text.endswith("\n")  # torn
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[-1])
    rc = train_mod.main(args_for(tmp_path, "--max_iters=8", "--eval_interval=5") + ["--resume"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "dropped 1 unreadable line(s)" in err
    rows = metrics(folder)
    assert [r["iter"] for r in rows if "loss" in r] == list(range(1, 9))


def test_read_only_folder_while_writing_config_toml(tmp_path, monkeypatch):
    real = os.replace

    def replace(src, dst, *a, **k):
        if os.path.basename(dst) == "config.toml":
            raise os_error(errno.EROFS, src)
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(train_mod.TrainError) as e:
        train_mod.train(cfg_for(tmp_path, "--max_iters=2"))
    folder = run_dir(tmp_path)
    assert f"could not write {os.path.join(folder, 'config.toml')} (Read-only file system)" in str(e.value)
    assert sorted(os.listdir(folder)) == []  # no temp file, no lock left


# ------------------------------------------------------------------------------------------- torn metrics

def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    train_mod.train(cfg_for(tmp_path, "--max_iters=4", "--eval_interval=2"))
    folder = run_dir(tmp_path)
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
        f.write('{"iter": 5, "loss": 2.1, "lr": 0.00')  # a kill during the append of step 5
    capsys.readouterr()
    train_mod.train(cfg_for(tmp_path, "--max_iters=6", "--eval_interval=2", "--init_from=resume"))
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().err
    rows = metrics(folder)
    assert [r["iter"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["iter"] for r in rows if "val_loss" in r] == [0, 2, 4, 6]
    assert runlog.read_metrics(os.path.join(folder, "metrics.jsonl")) == rows
