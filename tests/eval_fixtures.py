"""Small models and data for the evaluation tests: tiny random GPTs, a rigged "oracle" model, checkpoints."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn as nn

from data.tokenizers import CharTokenizer
from model import GPT, GPTConfig
from model.checkpoint import save_checkpoint
from tests.util import ROOT

HELLASWAG_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hellaswag_mini.jsonl")
GPT2_VOCAB = 50304  # 50257 padded to a multiple of 64, as train.py does


def tiny_gpt(vocab_size: int, block_size: int = 32, seed: int = 0, dtype=torch.float32, n_layer: int = 2) -> GPT:
    """A random GPT with larger-than-default weights, so that its predictions differ clearly between tokens."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=2, n_embd=16,
                          attention="sdpa"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model.to(dtype).eval()


def char_tokenizer_for(*texts: str) -> CharTokenizer:
    return CharTokenizer("".join(texts) + " ")


def save_tiny_checkpoint(folder, model: GPT, tokenizer_spec: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "ckpt_0000000.pt")
    save_checkpoint({"model": model.state_dict(), "config": {"model": dataclasses.asdict(model.config)},
                     "tokenizer": tokenizer_spec, "iter": 0}, path)
    return path


class OracleModel(nn.Module):
    """A rigged language model: where the tokens so far are a prefix of one of `certain` sequences, the next
    token of that sequence gets logit `margin` (every other token 0); elsewhere every token has logit 0.

    So a continuation that follows a certain sequence scores about 0 per token (exactly
    -log(1 + (V - 1)·e^-margin)), and any other token scores -margin - log(1 + (V - 1)·e^-margin) at the
    first position where it leaves the sequence. Same calling convention as GPT for the scoring code."""

    def __init__(self, vocab_size: int, certain: list[list[int]], block_size: int = 64, margin: float = 30.0):
        super().__init__()
        self.config = GPTConfig(block_size=block_size, vocab_size=vocab_size)
        self.lm_head = nn.Linear(1, vocab_size, bias=False)  # only its device is read
        self.certain, self.margin = [list(s) for s in certain], margin
        self.forwards = 0

    def forward(self, idx: torch.Tensor, targets=None, input_pos=None):
        self.forwards += 1
        B, T = idx.shape
        logits = torch.zeros(B, T, self.config.vocab_size, dtype=torch.float64)  # (B, T, V)
        rows = idx.tolist()
        for b in range(B):
            for t in range(T):
                prefix = rows[b][:t + 1]
                for seq in self.certain:
                    if len(seq) > t + 1 and seq[:t + 1] == prefix:
                        logits[b, t, seq[t + 1]] = self.margin
                        break
        return logits, None
