"""Evaluation of flashgpt models on tasks other than their own validation loss.

    scoring.py         log-likelihood of continuations given contexts, batched (the core of every task)
    hellaswag.py       HellaSwag: reading the data, scoring it as multiple choice (acc, acc_norm)
    perplexity.py      token/word/byte perplexity and bits per byte on held-out text
    train_hook.py      HellaSwag every `train.eval_hellaswag_interval` steps of a training run
    lm_eval_adapter.py lm-evaluation-harness's `LM` interface over a flashgpt model (optional dependency)

The entry point is eval.py at the repository root.
"""
