"""How a GPT is spread over data-parallel ranks for training: DDP or FSDP2, activation checkpointing, compile.

    check_parallel(t, device, dtype)              # ConfigError, one line, for a combination that cannot run
    start_single_process_group(device)            # FSDP2 on one process without torchrun
    enable_activation_checkpointing(model)        # each block recomputes its activations in backward
    compile_blocks(model, k)                      # compiled blocks: one call per unit of k (one function for all)
    compile_root(model)                           # compiled embeddings, and final norm, head and loss
    broadcast_parameters(model)                   # rank 0's initial weights on every rank
    shard_model(model, device, compute_dtype, k)  # FSDP2, in place: fully_shard each unit of k blocks, then the root
    set_gradient_sync(model, sync)                # FSDP2 gradient accumulation without communication
    grad_norm = clip_grad_norm(model, max_norm)   # one plain tensor, sharded or not
    sharded_state(model, optimizer) / optimizer_groups(model, optimizer) / load_sharded_state(...)

`parallel = "ddp"`: every rank holds the whole model (train.py wraps it in DistributedDataParallel when the world
has more than one rank; one process is plain single-process training).

`parallel = "fsdp"`: `torch.distributed.fsdp.fully_shard` (FSDP2) on each unit of `train.fsdp_blocks_per_unit`
consecutive transformer blocks and on the root, so a rank keeps 1/world of every parameter, gradient and AdamW
moment, and gathers a unit's parameters only while its blocks run. Larger units gather more at once (more
memory) and cost the host less per step: FSDP2's hooks run once per unit and micro-batch (train.py's default:
auto_blocks_per_unit). The modules keep their class names and parameter names (checkpoints use the same keys as
unsharded ones); parameters become DTensors. With a compute dtype (bf16 on CUDA), each block's parameters are
gathered and used in that dtype and its gradients reduced in fp32 (a MixedPrecisionPolicy); the root
(embeddings, final norm, tied head) keeps fp32 parameters, so the residual stream stays fp32 as under plain
autocast, which still picks each op's dtype. On the CPU nothing is cast (fp32).

Activation checkpointing and compile change a block's `forward` only (an instance attribute), never the module
tree: both work under either mode. Compile follows torchtitan's order, activation checkpointing, then torch.compile
per transformer block, then fully_shard; here the compiled function is one for all blocks (a block is an
argument, so it is traced once and reused), or, with units of several blocks, one call per unit that runs all
of its blocks (traced once per unit length). compile_root does the same for the root's own work around the
blocks (GPT.embed and GPT.head: instance attributes too), so under FSDP2 nothing but the module hooks runs eager.
Under DDP train.py compiles the whole model instead.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from .config import ConfigError

MODEL_PREFIX, OPTIM_PREFIX = "model/", "optim/"  # sharded state keys: model/<name>, optim/<name>/<state>

__all__ = ["auto_blocks_per_unit", "broadcast_parameters", "check_parallel", "clip_grad_norm", "compile_blocks",
           "compile_root", "enable_activation_checkpointing", "end_single_process_group", "fsdp_available",
           "load_full_optimizer_state", "load_sharded_state", "optimizer_groups", "optimizer_param_names",
           "optimizer_state_dict", "set_gradient_sync", "shard_model", "sharded_state", "start_single_process_group"]


def fsdp_available() -> bool:
    """Whether this torch has torch.distributed and FSDP2's fully_shard."""
    try:
        import torch.distributed as dist
        if not dist.is_available():
            return False
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def check_parallel(t, device: torch.device, dtype: torch.dtype) -> None:
    """ConfigError (one line) when train.parallel cannot run as configured (activation checkpointing runs with
    either mode, compiled or not, any dtype)."""
    if t.parallel == "fsdp":
        if not fsdp_available():
            raise ConfigError(f"train.parallel=fsdp: this torch ({torch.__version__}) has no torch.distributed "
                              "FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); use train.parallel=ddp")
        if dtype == torch.float16:
            raise ConfigError("train.parallel=fsdp with train.dtype=float16: the loss scaler would check only "
                              "this rank's gradient shard for overflow; use train.dtype=bfloat16 or float32")


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h)


# ---------------------------------------------------------------------------------- activation checkpointing

def _checkpointed_call(block: nn.Module, *args, **kwargs):
    """A block's own forward under non-reentrant activation checkpointing: only its input is kept for backward,
    its activations are recomputed there (with the RNG state of the forward, so dropout masks match)."""
    from torch.utils.checkpoint import checkpoint
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def _plain_call(block: nn.Module, *args, **kwargs):
    return type(block).forward(block, *args, **kwargs)


class _BlockForward:
    """A block's `forward`: `fn(block, *args)`, where fn is the plain or checkpointed call, maybe compiled.
    An object rather than a closure, so compile_blocks can replace fn and the same fn serves every block."""

    def __init__(self, block: nn.Module, fn):
        self.block, self.fn = block, fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.block, *args, **kwargs)


def _block_forward(block: nn.Module) -> _BlockForward:
    forward = block.__dict__.get("forward")
    if forward is None:
        forward = block.forward = _BlockForward(block, _plain_call)
    elif not isinstance(forward, _BlockForward):
        raise RuntimeError("the blocks already run as compiled units (compile_blocks): enable activation "
                           "checkpointing before compiling")
    return forward


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Every transformer block keeps only its input for backward and recomputes the rest there. Parameter
    names and the module tree do not change. Call before compile_blocks."""
    for block in _blocks(model):
        forward = _block_forward(block)
        if forward.fn is not _plain_call:
            raise RuntimeError("enable_activation_checkpointing: call it before compile_blocks, once")
        forward.fn = _checkpointed_call


_compiled: dict = {}  # (the plain or checkpointed call, unit or block) → its torch.compile'd version, shared


def _run_unit(call, blocks: tuple, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Every block of a unit in turn, each through `call` (the plain or checkpointed call).
    x: (B, T, C) → (B, T, C)."""
    for block in blocks:
        x = call(block, x, *args, **kwargs)
    return x


class _UnitForward:
    """The forward of a unit's first block: the whole unit (_run_unit, maybe compiled). Its other blocks pass
    their input through (_pass_through), so the model's loop over blocks is unchanged and every block's module
    hooks (FSDP2's gather before the unit, reshard and backward hooks after it) still run in order."""

    def __init__(self, blocks: tuple, call, fn):
        self.blocks, self.call, self.fn = blocks, call, fn

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.fn(self.call, self.blocks, x, *args, **kwargs)


def _pass_through(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return x


def compile_blocks(model: nn.Module, blocks_per_unit: int = 1, **compile_kwargs) -> None:
    """torch.compile the transformer blocks' forward (FSDP2's hooks stay outside, in eager). blocks_per_unit=1:
    each block's forward, one compiled function for all blocks (traced once and reused). k > 1: each unit of k
    consecutive blocks (shard_model's units) runs as one compiled call from its first block, its other blocks
    passing the result through: one compiled forward and backward per unit instead of per block, so a
    micro-batch costs the host a handful of compiled calls instead of one per block (and Inductor fuses across
    the blocks' boundaries). Embeddings, final norm, head and loss: compile_root."""
    if blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit={blocks_per_unit}: must be at least 1")
    blocks = _blocks(model)
    if blocks_per_unit == 1:
        for block in blocks:
            forward = _block_forward(block)
            key = (forward.fn, tuple(sorted(compile_kwargs.items())))
            if key not in _compiled:
                _compiled[key] = torch.compile(forward.fn, **compile_kwargs)
            forward.fn = _compiled[key]
        return
    calls = set()
    for block in blocks:
        forward = block.__dict__.get("forward")
        calls.add(_plain_call if forward is None else getattr(forward, "fn", None))
    if len(calls) != 1 or not calls <= {_plain_call, _checkpointed_call}:
        raise RuntimeError("compile_blocks: call it once, after enable_activation_checkpointing (if at all)")
    call = calls.pop()
    key = (_run_unit, tuple(sorted(compile_kwargs.items())))
    if key not in _compiled:
        _compiled[key] = torch.compile(_run_unit, **compile_kwargs)
    for i in range(0, len(blocks), blocks_per_unit):
        unit = tuple(blocks[i:i + blocks_per_unit])
        unit[0].forward = _UnitForward(unit, call, _compiled[key])
        for block in unit[1:]:
            block.forward = _pass_through


def _embed_call(model: nn.Module, *args, **kwargs):
    """The model's own embed (GPT.embed), whatever its instance attribute."""
    return type(model).embed(model, *args, **kwargs)


def _head_call(model: nn.Module, *args, **kwargs):
    """The model's own head (GPT.head), whatever its instance attribute."""
    return type(model).head(model, *args, **kwargs)


class _RootPart:
    """A model's `embed` or `head`: `fn(model, *args)`, fn the compiled _embed_call or _head_call (one for all
    models: the model is an argument)."""

    def __init__(self, model: nn.Module, fn):
        self.model, self.fn = model, fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def compile_root(model: nn.Module, **compile_kwargs) -> None:
    """torch.compile the root's own work around the blocks: GPT.embed (token and position embeddings, dropout,
    RoPE's cos and sin) and GPT.head (final norm, LM head, loss), each one compiled call per forward. The
    module hooks (FSDP2's gather of the root's parameters before forward, its reduction after backward) run
    around the model's forward, outside both; the module tree and parameter names do not change. With
    compile_blocks, a sharded model's forward runs nothing eager but those hooks and the loop over blocks."""
    for name, call in (("embed", _embed_call), ("head", _head_call)):
        if name in model.__dict__:
            raise RuntimeError(f"compile_root: the model's {name} is compiled already; call it once")
        key = (call, tuple(sorted(compile_kwargs.items())))
        if key not in _compiled:
            _compiled[key] = torch.compile(call, **compile_kwargs)
        setattr(model, name, _RootPart(model, _compiled[key]))


# ------------------------------------------------------------------------------------------------ FSDP2

def start_single_process_group(device: torch.device) -> bool:
    """A default process group of one rank (FSDP2 shards over a process group, even of one) when none exists:
    NCCL on CUDA, gloo on the CPU, rendezvous in memory (no port). True when it started one."""
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())  # "cuda" alone
        backend = "nccl"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def end_single_process_group() -> None:
    """End the default process group (the one start_single_process_group started)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers to every rank (what DDP does when it wraps a model), so a
    sharded run starts from the same weights as one process seeded like rank `src`."""
    import torch.distributed as dist
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src)


AUTO_UNIT_MAX = 12  # blocks in an automatic FSDP2 unit on one rank (the largest measured: GPT-2 124M's 12)


def auto_blocks_per_unit(n_layer: int, world: int) -> int:
    """train.fsdp_blocks_per_unit = 0: on several ranks one block per unit (each unit's gather overlaps the
    compute before it); on one rank, with nothing to overlap, the blocks in as few units as hold at most
    AUTO_UNIT_MAX each, evened out (30 blocks: 3 units of 10), so the host makes few calls per micro-batch and
    compile traces one unit's graph (two where the units cannot be even), not the whole depth."""
    if world > 1:
        return 1
    units = -(-n_layer // AUTO_UNIT_MAX)
    return -(-n_layer // units)


def shard_model(model: nn.Module, device: torch.device, compute_dtype: torch.dtype | None = None,
                blocks_per_unit: int = 1) -> nn.Module:
    """FSDP2 in place over all ranks of the default process group: fully_shard each unit of blocks_per_unit
    consecutive transformer blocks (gathered and resharded together), then the root (which then holds the
    embeddings, final norm and the tied head). compute_dtype (e.g. bf16): the blocks' parameters are gathered
    in it and their gradients reduced in fp32; None keeps everything fp32. The last unit keeps its parameters
    gathered after forward (backward needs them first). Each parameter is sharded on its own whatever the
    units, so a checkpoint loads under any blocks_per_unit. Returns the model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if compute_dtype is None or compute_dtype == torch.float32:
        block_policy = MixedPrecisionPolicy()
    else:
        # inputs stay as they come (the fp32 residual stream); autocast casts each op's inputs
        block_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                            cast_forward_inputs=False)
    if blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit={blocks_per_unit}: must be at least 1")
    blocks = _blocks(model)
    units = [blocks[i:i + blocks_per_unit] for i in range(0, len(blocks), blocks_per_unit)]
    for i, unit in enumerate(units):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=block_policy,
                    reshard_after_forward=i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    _units[model] = units
    return model


_units: "weakref.WeakKeyDictionary[nn.Module, list[list[nn.Module]]]" = weakref.WeakKeyDictionary()
# a sharded model → its units of blocks (shard_model), for set_gradient_sync


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """For a step of several micro-batches of a sharded model: sync=False before the first, sync=True before the
    last (the setting stays in between; each call walks every module). With sync off, gradients accumulate
    unsharded on each rank, with no reduce-scatter, and the blocks' parameters stay gathered from one
    micro-batch to the next (no all-gather); sync=True restores reduce-scatter and resharding for the last one."""
    model.set_requires_gradient_sync(sync)
    model.set_reshard_after_backward(sync)
    units = _units.get(model) or [[block] for block in _blocks(model)]
    for i, unit in enumerate(units):
        unit[0].set_reshard_after_forward(sync and i < len(units) - 1, recurse=False)  # the unit's one state


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over all parameters (a sharded model's norm covers every rank's shard); returns the total
    norm before clipping as a plain 0-d tensor, not yet read back. Under FSDP2 it works on each rank's local
    shards: their squared norms summed over the ranks in one all-reduce (each element lives on one rank), then
    one scale of the local shards; DTensor's dispatch would take host time for every gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    shards = _local_shards(grads)
    if shards is None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        full = getattr(norm, "full_tensor", None)  # a DTensor (replicated): gradients sharded some other way
        return full() if full is not None else norm
    import torch.distributed as dist
    local, group = shards
    with torch.no_grad():
        squares = torch.stack(torch._foreach_norm(local)).float().square().sum()  # this rank's share
        dist.all_reduce(squares, group=group)
        total = squares.sqrt()
        torch._foreach_mul_(local, torch.clamp(max_norm / (total + 1e-6), max=1.0))  # as clip_grad_norm_ does
    return total


def _local_shards(grads: list) -> tuple[list[torch.Tensor], object] | None:
    """(each gradient's local shard, the process group) when every gradient is a DTensor sharded on dim 0 over
    one 1-D mesh (FSDP2's layout: each element on exactly one rank); otherwise None."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        return None
    if not grads or not all(isinstance(g, DTensor) for g in grads):
        return None
    mesh, sharded = grads[0].device_mesh, (Shard(0),)
    if mesh.ndim != 1 or any((g.device_mesh is not mesh and g.device_mesh != mesh) or g.placements != sharded
                             for g in grads):
        return None
    with torch.no_grad():  # to_local without an autograd node: the shard itself
        return [g.to_local() for g in grads], mesh.get_group()


# ---------------------------------------------------------------------------------------- sharded state

def optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """For each param group, the names of its parameters in the optimizer's order (the integer keys of
    optimizer.state_dict() count through these lists)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's param groups as JSON-able dicts: hyperparameters, and "params" as parameter names."""
    names = optimizer_param_names(model, optimizer)
    groups = []
    for group, group_names in zip(optimizer.param_groups, names):
        entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        entry["params"] = group_names
        groups.append(entry)
    return groups


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(tensors, tied) of a sharded model and its optimizer, for torch.distributed.checkpoint.

    tensors: "model/<name>" → the parameter (a DTensor shard, shared storage), "optim/<name>/<key>" → its AdamW
    state (step, exp_avg, exp_avg_sq). A parameter reachable under a second name (the head tied to the token
    embedding) appears once; tied maps the second name to the first.
    """
    tensors, tied, seen = {}, {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            tied[name] = seen[id(value)]
            continue
        seen[id(value)] = name
        tensors[MODEL_PREFIX + name] = value.detach()
    names = [n for group in optimizer_param_names(model, optimizer) for n in group]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, p in zip(names, params):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM_PREFIX}{name}/{key}"] = value
    return tensors, tied


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, groups: list[dict], saved: dict,
                       read) -> None:
    """Fill a sharded model and its fresh optimizer from a sharded checkpoint.

    groups: the checkpoint's optimizer_groups; saved: key → (shape, dtype) of every tensor it holds;
    read(targets): loads each of `targets` (keys as sharded_state's; this rank's DTensor shards) in place,
    resharding as needed. ValueError (one line) when the checkpoint's weights do not fit this model.
    """
    tensors, _ = sharded_state(model, optimizer)
    targets = {k: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}  # the parameters themselves
    for key, value in targets.items():
        name = key[len(MODEL_PREFIX):]
        if key not in saved:
            raise ValueError(f"it has no weight {name}")
        if tuple(saved[key][0]) != tuple(value.shape):
            raise ValueError(f"{name} is {tuple(saved[key][0])} there, {tuple(value.shape)} here")
    by_name = dict(model.named_parameters())
    for group in groups:
        for name in group["params"]:
            if name not in by_name:
                raise ValueError(f"its optimizer state names {name}, which this model does not have")
            for key, (shape, dtype) in saved.items():
                if key.startswith(f"{OPTIM_PREFIX}{name}/") and "/" not in key[len(OPTIM_PREFIX) + len(name) + 1:]:
                    p = by_name[name]
                    targets[key] = torch.zeros_like(p) if tuple(shape) == tuple(p.shape) and shape else \
                        torch.zeros(shape, dtype=dtype)
    read(targets)
    _load_optimizer(model, optimizer, optimizer_state_dict(groups, targets))


def optimizer_state_dict(groups: list[dict], tensors: dict) -> dict:
    """optimizer.state_dict() format, in the saved order, from saved groups (parameter names in "params") and
    "optim/<name>/<key>" tensors."""
    per_param: dict[str, dict] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX):].rpartition("/")
            per_param.setdefault(name, {})[state_key] = value
    state, param_groups, index = {}, [], 0
    for group in groups:
        ids = []
        for name in group["params"]:
            if name in per_param:
                state[index] = per_param[name]
            ids.append(index)
            index += 1
        param_groups.append({**{k: (tuple(v) if k == "betas" else v) for k, v in group.items() if k != "params"},
                             "params": ids, "param_names": list(group["params"])})
    return {"state": state, "param_groups": param_groups}


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """optimizer.load_state_dict of `saved` (optimizer.state_dict() format whose groups carry "param_names"),
    renumbered to this optimizer's own order of the same parameters."""
    current = optimizer_param_names(model, optimizer)
    saved_names = [g["param_names"] for g in saved["param_groups"]]
    if [sorted(g) for g in current] != [sorted(g) for g in saved_names]:
        raise ValueError("its optimizer groups hold other parameters than this model's")
    state_of = {}
    for group in saved["param_groups"]:
        for saved_id, name in zip(group["params"], group["param_names"]):
            if saved_id in saved["state"]:
                state_of[name] = saved["state"][saved_id]
    state, groups, index = {}, [], 0
    for group, names in zip(saved["param_groups"], current):
        ids = []
        for name in names:
            if name in state_of:
                state[index] = state_of[name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, full: dict) -> None:
    """Load an unsharded optimizer.state_dict() (of a single-file checkpoint, saved in this model's parameter
    order) into the optimizer of a sharded model: each rank keeps its own shard of every moment, with no
    communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    names = optimizer_param_names(model, optimizer)
    by_name = dict(model.named_parameters())
    if [len(g["params"]) for g in full["param_groups"]] != [len(g) for g in names]:
        raise ValueError("its optimizer groups hold other parameters than this model's")
    state = {}
    for group, group_names in zip(full["param_groups"], names):
        for saved_id, name in zip(group["params"], group_names):
            p = by_name[name]
            entry = {}
            for key, value in full["state"].get(saved_id, {}).items():
                if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.shape == p.shape:
                    value = distribute_tensor(value.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                              src_data_rank=None)
                entry[key] = value
            if entry:
                state[saved_id] = entry
    groups = [{**g, "param_names": n} for g, n in zip(full["param_groups"], names)]
    _load_optimizer(model, optimizer, {"state": state, "param_groups": groups})
