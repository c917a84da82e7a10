"""ShardLocalAdamW (model/shard_adamw.py): under FSDP2 the step runs on the DTensors' local shards and updates
the parameters exactly as torch's AdamW does through DTensor dispatch; plain tensors pass through. On the CPU
(gloo, foreach) and, in the GPU suite, on CUDA (NCCL, fused)."""
from __future__ import annotations

import pytest
import torch

from model import GPT, GPTConfig

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40, attention="naive")


def _fsdp():
    pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed import fsdp
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2")


def _sharded_pair(device):
    """Two FSDP2 models of the same weights, one block per unit, on the one-rank group already started."""
    from model.parallel import shard_model
    torch.manual_seed(0)
    base = GPT(CFG)
    models = []
    for _ in range(2):
        m = GPT(CFG)
        m.load_state_dict(base.state_dict())
        m.to(device)
        shard_model(m, device, None, 1)
        models.append(m)
    return models


def _step(models, optimizers, steps, seed):
    import torch.distributed as dist
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        shapes = [p.shape for p in models[0].parameters()]
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for m, opt in zip(models, optimizers):
            for p, g in zip(m.parameters(), grads):
                p.grad = dist.tensor.distribute_tensor(g.to(p.device), p.device_mesh, p.placements)
            opt.step()
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", DEVICES)
def test_local_shard_steps_equal_torch_adamw_on_dtensors(device, monkeypatch):
    """Four steps of the optimizer GPT.configure_optimizer builds against torch.optim.AdamW with the same groups
    and settings on the same DTensor parameters: bit for bit the same parameters and moments; the functional
    adam it calls sees plain tensors only, and the state it keeps is DTensors (what sharded checkpoints save)."""
    _fsdp()
    import torch.distributed as dist
    import torch.optim.adam as adam_module
    from torch.distributed.tensor import DTensor
    from model.parallel import start_single_process_group
    from model.shard_adamw import ShardLocalAdamW
    device = torch.device(device)
    assert start_single_process_group(device)
    try:
        ours_model, torch_model = _sharded_pair(device)
        ours = ours_model.configure_optimizer(0.1, 3e-3, (0.9, 0.95), device.type)
        assert type(ours) is ShardLocalAdamW
        plist = list(torch_model.parameters())
        groups = [{k: v for k, v in g.items() if k not in ("foreach", "fused")} for g in ours.param_groups]
        groups = [dict(g, params=[p for p in plist if (p.dim() >= 2) == (i == 0)]) for i, g in enumerate(groups)]
        theirs = torch.optim.AdamW(groups, foreach=ours.defaults["foreach"], fused=ours.defaults["fused"])
        seen = []
        real = adam_module.adam

        def recording(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs):
            seen.append(tuple(type(t) for t in params + grads + exp_avgs + exp_avg_sqs))
            return real(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs)
        monkeypatch.setattr(adam_module, "adam", recording)
        _step((ours_model, torch_model), (ours, theirs), steps=4, seed=1)
        # per step: ours (one call per group), then torch's
        ours_types = {t for i, call in enumerate(seen) if i // 2 % 2 == 0 for t in call}
        theirs_types = {t for i, call in enumerate(seen) if i // 2 % 2 == 1 for t in call}
        assert len(seen) == 4 * 2 * 2  # 4 steps, 2 groups, 2 optimizers
        assert DTensor not in ours_types, ours_types
        assert DTensor in theirs_types
        for (name, p), q in zip(ours_model.named_parameters(), torch_model.parameters()):
            assert isinstance(p, DTensor)
            assert torch.equal(p.full_tensor(), q.full_tensor()), name
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = ours.state[p][key], theirs.state[q][key]
                assert isinstance(a, DTensor) and a.placements == p.placements
                assert torch.equal(a.full_tensor(), b.full_tensor()), (name, key)
            assert torch.equal(ours.state[p]["step"], theirs.state[q]["step"])
        assert not torch.equal(ours_model.lm_head.weight.full_tensor(),
                               GPT(CFG).to(device).lm_head.weight)  # the steps moved the weights
    finally:
        dist.destroy_process_group()


def test_plain_tensors_are_unchanged(monkeypatch):
    """Without DTensors the step is torch's AdamW's: the same updates, and plain tensors reach the functional
    adam as they are."""
    torch.manual_seed(0)
    a, b = GPT(CFG), GPT(CFG)
    b.load_state_dict(a.state_dict())
    ours = a.configure_optimizer(0.1, 3e-3, (0.9, 0.95), "cpu")
    theirs = torch.optim.AdamW([{"params": [p for p in b.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                                {"params": [p for p in b.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                               lr=3e-3, betas=(0.9, 0.95), foreach=True)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p, q in zip(a.parameters(), b.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_layouts_that_differ_stay_dtensors():
    """A gradient laid out unlike its parameter (replicated against sharded) or a partial sum is not unwrapped:
    the local shards would not be the same elements."""
    _fsdp()
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from model.parallel import start_single_process_group
    from model.shard_adamw import _same_local_layout
    assert start_single_process_group(torch.device("cpu"))
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        w = torch.randn(4, 3)
        sharded, replicated = distribute_tensor(w, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Replicate()])
        assert _same_local_layout([sharded], [[sharded.clone()], [sharded.clone()]])
        assert not _same_local_layout([sharded], [[replicated]])
        assert not _same_local_layout([sharded], [[w.clone()]])
        assert not _same_local_layout([w], [[w.clone()]])
        partial = dist.tensor.DTensor.from_local(w, mesh, [Partial()])
        assert not _same_local_layout([partial], [[partial]])
    finally:
        dist.destroy_process_group()
