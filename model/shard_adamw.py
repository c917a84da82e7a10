"""AdamW that updates FSDP2's DTensor parameters through their local shards.

torch's AdamW on DTensors sends its fused (or foreach) call through DTensor's dispatch: sharding propagation over
every parameter, gradient and moment of the step. AdamW is elementwise, so where a parameter, its gradient and its
moments are laid out alike (the same mesh and placements, none of them partial sums) the update of each rank's
local shards is the update of the whole tensor. This class hands the local shards to the same fused / foreach
kernels. Its state stays what torch's AdamW keeps (DTensor moments keyed by the DTensor parameters), so
checkpoints, `state_dict` and resharding on load do not change. Plain tensors pass through untouched.
"""
from __future__ import annotations

import torch


def _same_local_layout(params: list, others: list[list]) -> bool:
    """True when every parameter is a DTensor without partial placements and each gradient and moment at its
    index is a DTensor on the parameter's mesh with its placements: then an elementwise update of the local shards
    is the update itself."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    for i, p in enumerate(params):
        if not isinstance(p, DTensor) or any(pl.is_partial() for pl in p.placements):
            return False
        for items in others:
            t = items[i]
            if not isinstance(t, DTensor) or t.placements != p.placements or t.device_mesh != p.device_mesh:
                return False
    return True


class ShardLocalAdamW(torch.optim.AdamW):
    """torch.optim.AdamW, with the step's tensors replaced by their local shards when they are DTensors laid out
    alike (FSDP2: each parameter sharded on dim 0). Same arguments, same state, same updates."""

    def _init_group(self, group, *lists):
        # (group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps): torch fills the
        # lists, then passes them to its functional adam; swapping their items for local shards here keeps the
        # rest of torch's step as it is.
        out = super()._init_group(group, *lists)
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, _ = [x for x in lists if isinstance(x, list)]
        others = [grads, exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if max_exp_avg_sqs else [])
        if params and _same_local_layout(params, others):
            for items in [params] + others:
                items[:] = [t.to_local() for t in items]  # under no_grad: the shard itself, no autograd node
        return out
