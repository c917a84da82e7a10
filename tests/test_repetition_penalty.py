"""The repetition penalty (SamplingParams.repetition_penalty, generate.py --repetition-penalty): transformers'
rule on the logits of the tokens a sequence holds, the prompt's padding left out; greedy generation with it
chooses transformers' tokens for the same weights, offline."""
from __future__ import annotations

import pytest
import torch

from model import GPT
from model.generation import _prompt_tokens, generate
from model.sampling import SamplingParams, penalize

VOCAB = 128


def test_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0], [2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False], [False, False, False, False]])
    assert torch.equal(penalize(logits, seen, 2.0), torch.tensor([[1.0, -4.0, 1.0, -1.0], [2.0, -2.0, 1.0, -1.0]]))


def test_prompt_tokens_leave_out_the_padding():
    idx = torch.tensor([[5, 0, 0], [0, 7, 0]])  # right-padded with 0; the second prompt holds a real 0
    seen = _prompt_tokens(idx, torch.tensor([1, 2]), 9)
    assert seen[0].nonzero().flatten().tolist() == [5] and seen[1].nonzero().flatten().tolist() == [0, 7]


@torch.no_grad()
def test_greedy_with_a_penalty_chooses_transformers_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128,
                                                              vocab_size=VOCAB, bos_token_id=None, eos_token_id=None))
    for p in hf.parameters():  # off the init: clear margins between the greedy choices
        p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.08))
    hf.eval().save_pretrained(tmp_path, safe_serialization=True)
    model = GPT.from_pretrained(str(tmp_path))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9)]
    penalised = generate(model, prompts, SamplingParams(temperature=0.0, max_new_tokens=24,
                                                        repetition_penalty=1.6)).sequences
    for p, ours in zip(prompts, penalised):
        want = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, repetition_penalty=1.6,
                           pad_token_id=0)[0, len(p):].tolist()
        assert ours == want
    plain = generate(model, prompts, SamplingParams(temperature=0.0, max_new_tokens=24)).sequences
    assert plain != penalised  # the penalty changes the choices: the comparison above can fail
    assert max(len(s) - len(set(s)) for s in penalised) < max(len(s) - len(set(s)) for s in plain)
