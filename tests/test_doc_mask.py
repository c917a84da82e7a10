"""Document masking in the model and in training (train.doc_mask), and the model's sliding window.

A row packs documents, each ended by the end-of-text token. With their bounds (kernels.document_bounds) the
model attends within each document only and restarts positions (learned or RoPE) at each document start, so
each document's logits in the packed row are those it gets alone: checked in float64 (naive attention) and
through the flash kernels (Triton's interpreter on the CPU, float32), learned positions and RoPE, MHA and GQA.
Training with train.doc_mask = true on token shards takes the bounds from each batch, resumes exactly, and a
corpus without an end-of-text token is refused with one line.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

import kernels
import train as train_mod
from config import load_config
from model import GPT, GPTConfig
from model.checkpoint import load_checkpoint
from model.config import ConfigError
from tests.util import TINY_MODEL, write_corpus

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # flash: the GPU, else the interpreter
V = 61
EOT = V - 1


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=32, attention="naive")
    base.update(kw)
    return GPTConfig(**base)


ARCHS = {"gpt2": dict(), "llama-gqa": dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2)}


def packed_rows(lengths_per_row, g):
    """(B, T) token rows of documents of the given lengths, each ending with EOT, and the documents themselves."""
    rows, docs = [], []
    for lengths in lengths_per_row:
        row = []
        for n in lengths:
            doc = torch.randint(0, EOT, (n,), generator=g)
            doc[-1] = EOT
            docs.append(doc)
            row.append(doc)
        rows.append(torch.cat(row))
    return torch.stack(rows), docs


LAYOUT = [[5, 1, 9, 17, 8], [40]]  # a one-token document, several per row, a row holding one document


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("backend", ["naive", "flash", "sdpa"])
def test_packed_row_gives_each_document_its_own_logits(backend, arch):
    """The logits of every document in a packed row (docs given) equal those of the document run alone; without
    the bounds the later documents' logits differ (they see the earlier ones)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    dtype, tol = (torch.float32, 2e-5) if backend == "flash" else (torch.float64, 1e-10)
    device = DEVICE if backend == "flash" else "cpu"
    model = GPT(tiny(attention=backend, **ARCHS[arch])).to(device, dtype).eval()
    idx, docs = packed_rows(LAYOUT, g)
    idx = idx.to(device)
    bounds = kernels.document_bounds(idx, EOT)
    with torch.no_grad():
        packed, _ = model(idx, docs=bounds)
        plain, _ = model(idx)
        alone = [model(doc[None].to(device))[0][0] for doc in docs]
    want = torch.cat([torch.cat(alone[:5]), alone[5]]).view(2, 40, V)
    torch.testing.assert_close(packed, want, atol=tol, rtol=tol)
    assert (plain[0, 5:] - want[0, 5:]).abs().max() > 1e-3  # the mask and the positions made the difference


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_layer_attends_with_the_positions_of_the_document_alone(arch, monkeypatch):
    """The q, k, v each layer attends with (RoPE applied) are, for the second document of a packed row, those
    it gets alone: positions restart at its start. RoPE scores depend on relative positions only, so a RoPE
    model's logits hardly show absolute positions that ran on; its rotated q and k do."""
    seen = []
    real = kernels.attention_qkvpacked

    def spy(qkv, *args, **kwargs):
        seen.append(qkv.detach().clone())  # (B, T, (nh + 2·nkv)·hd)
        return real(qkv, *args, **kwargs)

    monkeypatch.setattr(kernels, "attention_qkvpacked", spy)
    torch.manual_seed(3)
    model = GPT(tiny(**ARCHS[arch])).double().eval()
    idx, docs = packed_rows([[7, 12]], torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(idx, docs=kernels.document_bounds(idx, EOT))
        packed = seen[:]
        seen.clear()
        model(docs[1][None])
    assert len(packed) == len(seen) == model.config.n_layer
    for layer, (a, b) in enumerate(zip(packed, seen)):
        torch.testing.assert_close(a[:, 7:], b, atol=1e-12, rtol=0, msg=f"layer {layer}")


def test_flash_backward_with_documents_matches_naive():
    """Loss gradients of a packed batch through the flash kernels equal naive attention's (float32)."""
    torch.manual_seed(1)
    model = GPT(tiny(**ARCHS["llama-gqa"])).to(DEVICE)
    idx, _ = packed_rows(LAYOUT, torch.Generator().manual_seed(1))
    idx = idx.to(DEVICE)
    targets = torch.roll(idx, -1, dims=1)
    bounds = kernels.document_bounds(idx, EOT)
    grads = {}
    for backend in ("naive", "flash"):
        model.zero_grad()
        model.set_attention_backend(backend)
        _, loss = model(idx, targets, docs=bounds)
        loss.backward()
        grads[backend] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["flash"], grads["naive"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("backend", ["naive", "flash"])
def test_attention_window_limits_what_a_token_sees(backend, arch):
    """attention_window = 4 with 2 layers (GPT-2 blocks; Llama-family blocks with RoPE and GQA): a token's
    logits depend on at most the 2 * 3 tokens before it, and they agree with the naive reference."""
    torch.manual_seed(2)
    model = GPT(tiny(attention=backend, attention_window=4, n_layer=2, **ARCHS[arch])).to(DEVICE).eval()
    idx = torch.randint(0, V, (1, 30), device=DEVICE)
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % V
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
        model.set_attention_backend("naive")
        ref = model(idx)[0]
    assert torch.equal(a[:, :10], b[:, :10]) and torch.equal(a[:, 17:], b[:, 17:])  # outside 10..16: untouched
    assert (a[:, 10:17] - b[:, 10:17]).abs().amax(-1).min() > 0  # inside: each position moved
    torch.testing.assert_close(a, ref, atol=2e-5, rtol=2e-5)


def test_model_refuses_what_it_cannot_do():
    """Bounds that do not fit the batch, a negative window; a windowed model of GPT-2 blocks in a Hugging Face
    export (GPT-2 has no window; Llama-family blocks export as Mistral, tests/test_export.py)."""
    model = GPT(tiny())
    idx = torch.randint(0, V, (2, 8))
    with pytest.raises(ValueError, match="docs must be"):
        model(idx, docs=kernels.document_bounds(idx[:, :7], EOT))
    with pytest.raises(ConfigError, match="model.attention_window=-1"):
        tiny(attention_window=-1).validate()
    from model.export import ExportError, hf_family
    with pytest.raises(ExportError, match="attention_window=8"):
        hf_family(tiny(attention_window=8))


# ------------------------------------------------------------------------------------------------- training

def short_documents(folder, n: int = 120, seed: int = 0) -> str:
    """A .jsonl corpus of short texts (a few to 40 characters: several documents per 64-token row)."""
    rng = random.Random(seed)
    words = ["a", "king", "sword", "night", "love", "crown", "thou", "fair"]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "docs.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 7)))}) + "\n")
    return path


def cfg_for(tmp_path, *extra):
    return load_config(None, [f"--dataset={short_documents(tmp_path / 'src')}", "--format=shards",
                              "--tokenizer=char", "--shard_tokens=800", "--val_docs=10",
                              f"--cache_dir={tmp_path}/cache", f"--out_dir={tmp_path}/run", "--num_proc=1",
                              "--batch_size=4", "--learning_rate=3e-3", "--min_lr=3e-4", "--warmup_iters=2",
                              "--eval_iters=2", "--log_interval=1", "--device=cpu", *TINY_MODEL, "--block_size=64",
                              *extra])


def metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_doc_mask_trains_and_resumes_exactly(tmp_path, monkeypatch):
    """train.doc_mask = true: every forward (training and evaluation) gets the bounds of its batch's documents;
    the losses differ from unmasked training, and a run resumed from a checkpoint logs exactly what the
    uninterrupted run logs."""
    seen = []
    bounds = kernels.document_bounds

    def spy(x, eot):
        seen.append((x.shape, eot, int((x == eot).sum())))
        return bounds(x, eot)

    monkeypatch.setattr(kernels, "document_bounds", spy)
    common = ["--eval_interval=4", "--lr_decay_iters=8", "--dropout=0.1", "--attention=naive"]
    a = cfg_for(tmp_path / "a", "--max_iters=8", "--doc_mask=true", *common)
    train_mod.train(a)
    spec = load_checkpoint(a.train.out_dir)["tokenizer"]
    assert spec["kind"] == "char" and spec.get("eot")  # char shards end every document with their own token
    assert seen and all(shape == (4, 64) and eot == len(spec["chars"]) for shape, eot, _ in seen)
    assert sum(n for _, _, n in seen) > len(seen)  # rows held several documents
    seen.clear()
    off = cfg_for(tmp_path / "off", "--max_iters=8", *common)
    train_mod.train(off)
    assert not seen  # without doc_mask the model gets no bounds
    la = [(r["iter"], r["loss"]) for r in metrics(a.train.out_dir) if "loss" in r]
    assert la != [(r["iter"], r["loss"]) for r in metrics(off.train.out_dir) if "loss" in r]

    b = cfg_for(tmp_path / "b", "--max_iters=4", "--doc_mask=true", *common)
    train_mod.train(b)
    b2 = cfg_for(tmp_path / "b", "--max_iters=8", "--doc_mask=true", "--init_from=resume", *common)
    train_mod.train(b2)
    lb = [(r["iter"], r["loss"]) for r in metrics(b.train.out_dir) if "loss" in r]
    assert la == lb and len(la) == 8  # bit-identical on CPU
    ea = [(r["val_loss"], r["train_loss"]) for r in metrics(a.train.out_dir) if "val_loss" in r]
    assert ea == [(r["val_loss"], r["train_loss"]) for r in metrics(b.train.out_dir) if "val_loss" in r]


def test_doc_mask_without_end_of_text_token_is_one_line(tmp_path, capsys):
    """Character data in the .bin format has no end-of-text token: doc_mask stops with one line, exit status 2,
    before the data is tokenised or anything is written into the run folder."""
    corpus = write_corpus(tmp_path)
    out = tmp_path / "run"
    code = train_mod.main([f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", f"--out_dir={out}",
                           "--num_proc=1", "--device=cpu", "--max_iters=2", "--doc_mask=true", *TINY_MODEL])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: train.doc_mask = true needs documents that end with an end-of-text token")
    assert not out.exists() or set(os.listdir(out)) <= {".lock"}
    assert not (tmp_path / "cache").exists()
