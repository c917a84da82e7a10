"""Run logging: metrics.jsonl (always), a PNG loss curve, and wandb when asked for.

wandb is imported only when enabled. It runs online when an API key is configured and its server answers,
otherwise offline (a local run directory that `wandb sync` can upload later).

metrics.jsonl is one JSON object per line, appended; a write cut short (a kill, a full disk) can leave a torn
last line, which readers skip (`read_metrics`) and a resumed run drops (`rewind_metrics`). Write errors are
raised as OSError for the caller to report.
"""
from __future__ import annotations

import json
import os
import socket

from training.runfolder import atomic_file, write_text_atomic


def wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    netrc = os.path.expanduser("~/.netrc")
    if not has_key and os.path.isfile(netrc):
        with open(netrc) as f:
            has_key = "api.wandb.ai" in f.read()
    if not has_key:
        return "offline"
    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=2).close()
        return "online"
    except OSError:
        return "offline"


class RunLog:
    def __init__(self, out_dir: str, config: dict, *, use_wandb: bool = False, project: str = "flashgpt",
                 run_name: str = "", enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.plot_path = os.path.join(out_dir, "loss.png")
        self.wandb = None
        if enabled and use_wandb:
            import wandb  # lazy: not even imported when off
            mode = wandb_mode()
            self.wandb = wandb.init(project=project, name=run_name or None, config=config, mode=mode,
                                    dir=out_dir, resume="allow")
            print(f"wandb: logging {mode} to project {project!r}")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record.get("iter"))

    def plot(self) -> None:
        """Redraw loss.png from metrics.jsonl: train loss per step, train/val loss at evaluations.
        Replaces loss.png whole or not at all; raises OSError when it cannot be written."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        plot_loss_curves(self.path, self.plot_path)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _parse_rows(lines) -> tuple[list[dict], list[str]]:
    """(rows, unreadable lines): the JSON objects among `lines`, and the lines that are not one."""
    rows, bad = [], []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(line)
    return rows, bad


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl; lines that are not a whole JSON object (a torn write) are skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return _parse_rows(f)[0]


def rewind_metrics(path: str, upto_iter: int) -> tuple[int, int]:
    """Keep the rows with iter <= upto_iter (a resumed run drops what the interrupted one logged after its
    checkpoint; upto_iter < 0 empties the file), and drop unreadable lines. The file is replaced atomically.
    Returns (rows dropped, unreadable lines dropped)."""
    if not os.path.isfile(path):
        return 0, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        rows, bad = _parse_rows(f)
    kept = [r for r in rows if r.get("iter", 0) <= upto_iter]
    if len(kept) < len(rows) or bad:
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(rows) - len(kept), len(bad)


def plot_loss_curves(metrics_path: str, png_path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot([r["iter"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.6, label="train (step)")
    if evals:
        ax.plot([r["iter"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval)")
        ax.plot([r["iter"] for r in evals], [r["val_loss"] for r in evals], "s-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_file(png_path, "wb") as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)
