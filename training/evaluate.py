"""Evaluation during training: mean train and val loss, with the documents masked as in training."""
from __future__ import annotations

import torch

import kernels
from data.loader import TokenData
from data.sharded_loader import ShardedData


def document_kwargs(x: torch.Tensor, eot_token: int | None) -> dict:
    """The model's keyword arguments for a batch x (B, T) on the device: {"docs": its document bounds} under
    train.doc_mask (eot_token set), else none (the model's plain call)."""
    return {} if eot_token is None else {"docs": kernels.document_bounds(x, eot_token)}


@torch.no_grad()
def estimate_loss(model, data: TokenData | ShardedData, t, device, autocast) -> dict:
    """Mean train and val loss over t.eval_iters batches each (documents masked as in training: t.doc_mask)."""
    model.eval()
    out = {}
    eot = data.eot_token if t.doc_mask else None
    for split in ("train", "val"):
        losses = []
        for x, y in data.eval_batches(split, t.batch_size, t.eval_iters):
            x = x.to(device)
            with autocast:
                _, loss = model(x, y.to(device), **document_kwargs(x, eot))
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out
