"""The errors a training run stops with: one line each."""
from __future__ import annotations


class TrainError(RuntimeError):
    """A problem that stops training with a one-line message (non-finite loss, unwritable run folder)."""


class Stopped(TrainError):
    """Training stopped on SIGINT/SIGTERM (after saving a checkpoint, or without one on a second Ctrl-C)."""
