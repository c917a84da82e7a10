"""What train.py builds a run from, besides the model and the data: the run folder (lock, atomic writes,
temporary files: runfolder.py), the log (metrics.jsonl, loss.png, wandb: runlog.py) and the start from
pretrained weights (a Hugging Face model or another run: pretrained.py)."""
