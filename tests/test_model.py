import math

import pytest
import torch

from model import GPT, GPTConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the flash tests: the GPU, else the interpreter


def tiny(**kw):
    base = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=64, attention="naive")
    base.update(kw)
    return GPTConfig(**base)


def test_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 97, (3, 32))
    targets = torch.randint(0, 97, (3, 32))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 32, 97)
    assert abs(loss.item() - math.log(97)) < 0.1  # an untrained model is close to uniform
    assert loss.requires_grad and not logits.requires_grad  # with targets only the loss is differentiable
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 5, 97) and loss is None and logits.requires_grad
    rows = torch.randint(0, 97, (3, 33))  # inputs and targets as shifted slices of one buffer (not contiguous)
    assert torch.equal(model(rows[:, :-1], rows[:, 1:])[1], model(rows[:, :-1].clone(), rows[:, 1:].clone())[1])


def test_weight_tying_and_gpt2_names():
    model = GPT(tiny())
    assert model.lm_head.weight is model.transformer.wte.weight
    names = set(dict(model.named_parameters()))
    for n in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight",
              "transformer.h.1.mlp.c_fc.weight", "transformer.ln_f.weight"):
        assert n in names
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * 2)) < 0.004  # GPT-2's scaled residual init


@pytest.mark.parametrize("n_kv_head", [0, 2, 1])
def test_backends_agree(n_kv_head):
    torch.manual_seed(1)
    model = GPT(tiny(n_kv_head=n_kv_head)).double()
    idx = torch.randint(0, 97, (2, 17))
    ref, _ = model(idx)
    model.set_attention_backend("sdpa")
    out, _ = model(idx)
    torch.testing.assert_close(out, ref)


def test_causality():
    torch.manual_seed(2)
    model = GPT(tiny())
    idx = torch.randint(0, 97, (1, 20))
    a, _ = model(idx)
    idx2 = idx.clone()
    idx2[0, 15:] = (idx2[0, 15:] + 1) % 97  # change the future
    b, _ = model(idx2)
    torch.testing.assert_close(a[:, :15], b[:, :15])


def test_flash_backend_matches_naive_forward_and_backward():
    """The model through the Triton kernel (the interpreter on CPU) gives the reference's logits and grads."""
    torch.manual_seed(3)
    model = GPT(tiny(n_kv_head=2)).to(DEVICE)
    idx = torch.randint(0, 97, (2, 19), device=DEVICE)
    targets = torch.randint(0, 97, (2, 19), device=DEVICE)
    grads = {}
    for backend in ("naive", "flash"):
        model.zero_grad()
        model.set_attention_backend(backend)
        logits, loss = model(idx, targets)
        loss.backward()
        grads[backend] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads["flash"][0], grads["naive"][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads["flash"][1], grads["naive"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_too_long_sequence_is_refused():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_unknown_backend_is_refused():
    model = GPT(tiny())
    model.set_attention_backend("magic")
    with pytest.raises(ValueError, match="unknown attention backend"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_compiled_model_with_flash_has_no_graph_break():
    """torch.compile(fullgraph=True) of the whole model with the flash kernel inside: the kernel is a custom op,
    so the model traces in one graph (aot_eager on CPU; inductor is what a GPU run uses)."""
    torch.manual_seed(4)
    model = GPT(tiny(attention="flash", n_kv_head=2)).to(DEVICE)
    idx = torch.randint(0, 97, (2, 17), device=DEVICE)
    targets = torch.randint(0, 97, (2, 17), device=DEVICE)
    eager_logits, eager_loss = model(idx, targets)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    logits, loss = compiled(idx, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_naive_attention_mask_equals_per_sequence_prefixes():
    """The reference's optional mask (used by the KV cache with per-sequence lengths): each sequence attends
    to its own valid prefix exactly as if the cache were cut there; a row that sees nothing is zero."""
    from kernels import naive_attention
    torch.manual_seed(5)
    q = torch.randn(2, 4, 1, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 16, dtype=torch.float64) for _ in range(2))
    lens = torch.tensor([4, 9])
    visible = (torch.arange(9)[None, :] < lens[:, None])[:, None, None, :]  # (B, 1, 1, L)
    out = naive_attention(q, k, v, causal=False, mask=visible)
    for b in range(2):
        want = naive_attention(q[b:b + 1], k[b:b + 1, :, :lens[b]], v[b:b + 1, :, :lens[b]], causal=False)
        torch.testing.assert_close(out[b:b + 1], want)
    nothing = naive_attention(q, k, v, causal=False, mask=torch.zeros(1, 1, 1, 9, dtype=torch.bool))
    assert torch.equal(nothing, torch.zeros_like(nothing))


def test_compiled_backward_has_no_gradient_input_for_the_logits():
    """With targets, the loss is the only differentiable output: the compiled backward takes one tangent (the
    loss's), not also a (B, T, vocab) one for the logits that would be zeros added to d(logits) at run time
    (a full extra pass over the logits' gradient per step; bench/NOTES.md)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    tangents = []

    def backward_compiler(gm, example_inputs):
        tangents.extend(n.target for n in gm.graph.nodes if n.op == "placeholder" and "tangent" in n.target)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm.forward), bw_compiler=backward_compiler)
    torch.manual_seed(0)
    model = GPT(tiny(attention="naive"))
    idx = torch.randint(0, 97, (2, 16))
    torch._dynamo.reset()
    _, loss = torch.compile(model, backend=backend)(idx, idx)
    loss.backward()
    assert len(tangents) == 1, tangents


def test_cpu_optimizer_is_multi_tensor_and_updates_as_one_tensor_at_a_time():
    """configure_optimizer on the CPU: AdamW's foreach path (fused on CUDA), whose updates equal the
    one-tensor-at-a-time path's bit for bit over several steps, decay on matrices only."""
    import copy
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=48, attention="naive")
    torch.manual_seed(0)
    model = GPT(cfg)
    other = copy.deepcopy(model)
    initial = copy.deepcopy(model.state_dict())
    optimizer = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(p.dim() >= 2 for p in optimizer.param_groups[0]["params"])
    index = {id(p): i for i, p in enumerate(model.parameters())}
    others = list(other.parameters())
    single = torch.optim.AdamW([{"params": [others[index[id(p)]] for p in g["params"]],
                                 "weight_decay": g["weight_decay"]} for g in optimizer.param_groups],
                               lr=1e-3, betas=(0.9, 0.95), foreach=False)
    for step in range(4):
        x = torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, optimizer), (other, single)):
            _, loss = m(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    assert all(not torch.equal(p, initial[name]) for name, p in model.named_parameters())  # all were updated
