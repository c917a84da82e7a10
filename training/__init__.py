"""A training run: the Trainer (trainer.py: setup, the step, evaluation, checkpoints) and what train.py builds it
from besides the model and the data: the run folder (lock, atomic writes, temporary files: runfolder.py), the log
(metrics.jsonl, loss.png, wandb: runlog.py), the start from pretrained weights (a Hugging Face model or another
run: pretrained.py), the learning-rate schedule and peak FLOP/s (schedule.py), evaluation (evaluate.py), stop
signals (signals.py), the torchrun process group (distributed.py) and the errors a run stops with (errors.py)."""
