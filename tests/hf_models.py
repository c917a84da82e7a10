"""Tiny Hugging Face model folders built offline for the tests: a byte-level BPE tokenizer.json trained on a small
corpus with the `tokenizers` library, and random transformers models saved next to it with save_pretrained."""
from __future__ import annotations

import json
import os

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(folder, texts: list[str], vocab_size: int = 300, chat_template: str | None = CHAT_TEMPLATE,
                    bos: str | None = None, eos: str = "<|endoftext|>") -> str:
    """tokenizer.json (byte-level BPE trained on `texts`; ids 0-2 are SPECIAL) + tokenizer_config.json in
    `folder`; `bos` set: a post-processor that starts every encoding with it, as Llama-3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
              "model_max_length": 1024}
    if chat_template:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


def randomised(model, seed: int = 0):
    """Every parameter moved off its init (norm weights off 1, biases off 0): a swapped or untransposed tensor
    changes the logits."""
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.08))
    return model.eval()


def tiny_llama(folder, vocab_size: int, family: str = "llama", **overrides):
    """A random LlamaForCausalLM (2 layers, 64 wide, GQA 4/2 heads; or the Mistral (a sliding window of 8 tokens),
    Phi-3, Qwen2, Qwen3, SmolLM3 (layer 2 without RoPE), OLMo 2 or Gemma 3 (a window of 8 tokens in layer 1, its
    own RoPE base there) model of that shape, or a GPT-2 of 2 layers, 64 wide) saved in `folder` with save_pretrained."""
    import transformers
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
               num_hidden_layers=2, vocab_size=vocab_size, max_position_embeddings=256, bos_token_id=None,
               eos_token_id=0, tie_word_embeddings=True)
    if family == "gpt2":
        cfg = dict(n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=vocab_size, bos_token_id=0,
                   eos_token_id=0)
    if family == "mistral":
        cfg["sliding_window"] = 8
    if family == "smollm3":
        cfg.update(no_rope_layer_interval=2, pad_token_id=None)
    if family in ("phi3", "olmo2"):
        cfg.update(pad_token_id=None)
    if family == "gemma3":
        cfg.update(pad_token_id=None, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2)
    names = {"llama": "Llama", "mistral": "Mistral", "phi3": "Phi3", "qwen2": "Qwen2", "qwen3": "Qwen3",
             "smollm3": "SmolLM3", "olmo2": "Olmo2", "gemma3": "Gemma3", "gpt2": "GPT2"}[family]
    config_cls = getattr(transformers, "Gemma3TextConfig" if family == "gemma3" else f"{names}Config")
    model_cls = getattr(transformers, "GPT2LMHeadModel" if family == "gpt2" else f"{names}ForCausalLM")
    hf = randomised(model_cls(config_cls(**{**cfg, **overrides})))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def char_spec(vocab_size: int) -> dict:
    """The spec of a character tokenizer of vocab_size ids (printable ASCII from the space on, then a newline)."""
    from data.tokenizers import CharTokenizer
    return CharTokenizer("".join(chr(c) for c in range(32, 32 + vocab_size - 1)) + "\n").spec()


def write_ckpt(path, model, tokenizer_spec: dict) -> str:
    """A training checkpoint of `model` (a GPT) at step 0 with this tokenizer, as train.py writes it; its path."""
    from config import RunConfig
    from model.checkpoint import save_checkpoint
    save_checkpoint({"model": model.state_dict(), "config": RunConfig(model=model.config).to_dict(),
                     "tokenizer": tokenizer_spec, "iter": 0}, str(path))
    return str(path)


def pretrained_llama(tmp, vocab_size: int, n_lines: int = 600):
    """(folder of a random Llama + a BPE tokenizer.json trained on a corpus, the transformers model, the corpus
    path), all under `tmp`: the start of a fine-tuning run."""
    from tests.util import write_corpus
    corpus = write_corpus(tmp / "corpus", n_lines=n_lines)
    with open(corpus) as f:
        lines = f.read().splitlines()
    folder = write_tokenizer(tmp / "tiny-llama", lines)
    return folder, tiny_llama(folder, vocab_size), corpus
