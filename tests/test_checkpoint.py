"""Checkpoint files under faults: damaged bytes, unsafe pickles, truncation, a full disk, stale temp files."""
import errno
import glob
import os
import shutil

import pytest
import torch

from model import checkpoint
from model.checkpoint import CheckpointError, atomic_save, load_checkpoint, save_run_checkpoint


def run_state(step: int) -> dict:
    """A checkpoint-shaped dict whose first tensor has bytes that are easy to find in the file."""
    weights = torch.arange(4096, dtype=torch.float32) + 1000.5 + step  # (4096,)
    return {"model": {"w": weights, "b": torch.zeros(3, dtype=torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 1e-3,
                                                                                          "betas": (0.9, 0.95)}]},
            "config": {"model": {"n_layer": 2}}, "iter": step, "best_val": 1.25, "version": 1}


def temp_files(folder) -> list[str]:
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(str(folder), ".tmp-*")))


def test_checkpoint_round_trip_is_verified(tmp_path):
    path = save_run_checkpoint(run_state(3), str(tmp_path), step=3, keep_last=2, is_best=True)
    for name in (path, str(tmp_path / "best.pt")):
        ckpt = load_checkpoint(name)
        assert ckpt["verified"] is True
        assert ckpt["iter"] == 3 and torch.equal(ckpt["model"]["w"], run_state(3)["model"]["w"])
    assert temp_files(tmp_path) == []


def test_flipped_byte_in_checkpoint_tensor_data(tmp_path):
    path = save_run_checkpoint(run_state(1), str(tmp_path), step=1, keep_last=2, is_best=False)
    raw = bytearray(open(path, "rb").read())
    at = raw.find(run_state(1)["model"]["w"].numpy().tobytes())
    assert at > 0
    raw[at + 4 * 1234 + 1] ^= 0x10  # one bit of one float: still a valid file, a slightly different weight
    with open(path, "wb") as f:
        f.write(raw)
    loaded = torch.load(path, weights_only=True)  # torch itself notices nothing
    assert not torch.equal(loaded["model"]["w"], run_state(1)["model"]["w"])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path))
    msg = str(e.value)
    assert path in msg and "checksum mismatch" in msg and "damaged" in msg and "\n" not in msg, msg


def test_checkpoint_without_checksum_still_loads_unverified(tmp_path):
    path = str(tmp_path / "old.pt")
    torch.save(run_state(2), path)  # what older versions wrote: no checksum entry
    ckpt = load_checkpoint(path)
    assert ckpt["verified"] is False and ckpt["iter"] == 2
    atomic_save(run_state(2), path)  # atomic_save writes the object as given
    assert load_checkpoint(path)["verified"] is False


def test_pickle_payload_in_a_checkpoint_is_unsafe_not_corrupt(tmp_path):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    path = str(tmp_path / "evil.pt")
    torch.save({"model": Payload(), "config": {}}, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert msg.startswith("refusing to unpickle") and path in msg and "not loaded" in msg, msg
    assert "corrupt" not in msg
    assert not marker.exists()


def test_truncated_checkpoint(tmp_path):
    path = save_run_checkpoint(run_state(1), str(tmp_path), step=1, keep_last=1, is_best=False)
    size = os.path.getsize(path)
    for keep in (0, 3, 10, size // 2, size - 1):
        with open(path, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(CheckpointError, match=rf"corrupt or truncated.*{os.path.basename(path)}"):
            load_checkpoint(path)


def test_checksum_covers_values_not_dict_order():
    a = run_state(1)
    b = {k: a[k] for k in reversed(list(a))}
    assert checkpoint.content_checksum(a) == checkpoint.content_checksum(b)
    for change in (lambda s: s["model"]["w"].__setitem__(5, 0.0), lambda s: s.__setitem__("iter", 2),
                   lambda s: s["model"].__setitem__("b", s["model"]["b"].float()),
                   lambda s: s["model"].__setitem__("w", s["model"]["w"].view(64, 64)),
                   lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", (0.9, 0.99))):
        c = run_state(1)
        change(c)
        assert checkpoint.content_checksum(c) != checkpoint.content_checksum(a)
    noncontiguous = {"t": torch.arange(12.0).view(3, 4).t()}  # (4, 3), strided
    contiguous = {"t": noncontiguous["t"].contiguous()}
    assert checkpoint.content_checksum(noncontiguous) == checkpoint.content_checksum(contiguous)


def test_best_pt_copy_on_full_disk(tmp_path, monkeypatch):
    """A full disk while refreshing best.pt: no temp file stays, best.pt and the new ckpt are whole."""
    out = str(tmp_path)
    save_run_checkpoint(run_state(1), out, step=1, keep_last=2, is_best=True)

    def full_disk_copy(src, dst, *a, **k):
        with open(dst, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_links(src, dst, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")  # a file system without hard links: a copy

    monkeypatch.setattr(shutil, "copyfile", full_disk_copy)
    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(OSError):
        save_run_checkpoint(run_state(2), out, step=2, keep_last=2, is_best=True)
    monkeypatch.undo()
    assert temp_files(out) == []
    assert load_checkpoint(os.path.join(out, "best.pt"))["iter"] == 1
    assert load_checkpoint(os.path.join(out, "ckpt_0000002.pt"))["verified"] is True
    assert load_checkpoint(os.path.join(out, "ckpt_0000001.pt"))["iter"] == 1


def test_best_pt_survives_pruning_of_its_numbered_checkpoint(tmp_path):
    out = str(tmp_path)
    save_run_checkpoint(run_state(1), out, step=1, keep_last=1, is_best=True)
    save_run_checkpoint(run_state(2), out, step=2, keep_last=1, is_best=False)
    assert sorted(os.listdir(out)) == ["best.pt", "ckpt_0000002.pt"]
    assert load_checkpoint(os.path.join(out, "best.pt"))["iter"] == 1
    assert load_checkpoint(out)["iter"] == 2


def test_remove_stale_temp_files(tmp_path):
    keep = ["ckpt_0000001.pt", "best.pt", "notes.tmp-1.pt", "metrics.jsonl"]
    stale = [".tmp-abc123.pt", ".tmp-x.pt"]
    for name in keep + stale:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".tmp-folder.pt").mkdir()  # only files this module writes are removed
    removed = checkpoint.remove_stale_temp_files(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == sorted(keep + [".tmp-folder.pt"])
    assert checkpoint.remove_stale_temp_files(str(tmp_path / "missing")) == []
