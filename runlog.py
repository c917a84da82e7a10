"""Run logging: metrics.jsonl (always), a PNG loss curve, and wandb when asked for.

wandb is imported only when enabled. It runs online when an API key is configured and its server answers,
otherwise offline (a local run directory that `wandb sync` can upload later).
"""
from __future__ import annotations

import json
import os
import socket


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
        """Redraw loss.png from metrics.jsonl: train loss per step, train/val loss at evaluations."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        plot_loss_curves(self.path, self.plot_path)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png_path)
