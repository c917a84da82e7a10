"""Chat templates: a Hugging Face tokenizer's Jinja chat template rendered into the text of a conversation.

    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": "Hi"}],
                       bos_token="<s>", eos_token="</s>")
    ids = tokenizer.encode(text, add_special_tokens=False)   # the template already wrote the special tokens

A template comes with a model from the hub, so it is untrusted code: it runs in Jinja's immutable sandbox
(no attribute access to Python internals, no mutation of the objects passed in), with the variables and helpers
that chat templates expect (messages, add_generation_prompt, bos_token, eos_token, raise_exception,
strftime_now, a tojson filter that keeps non-ASCII text). Any failure is a ChatTemplateError with one line.
"""
from __future__ import annotations

import json


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered (bad syntax, an unsafe operation, or its own raise_exception)."""


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    def strftime_now(fmt):
        import datetime
        return datetime.datetime.now().strftime(fmt)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # trim_blocks / lstrip_blocks: the whitespace handling the templates on the hub are written for
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


def render_chat(template: str, messages: list[dict], *, bos_token: str | None = None,
                eos_token: str | None = None, add_generation_prompt: bool = True) -> str:
    """The conversation `messages` ([{"role": ..., "content": ...}, ...]) as the template writes it; with
    add_generation_prompt, followed by the opening of the assistant's turn."""
    try:
        import jinja2
    except ImportError:
        raise ChatTemplateError("chat templates need the jinja2 package: pip install jinja2") from None
    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "")
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an unsafe operation, refused: {_one_line(e)}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template cannot be rendered ({type(e).__name__}: {_one_line(e)})") \
            from None
    except Exception as e:  # a template error raised as a Python error (a bad filter argument, a division by 0)
        raise ChatTemplateError(f"the chat template failed ({type(e).__name__}: {_one_line(e)})") from None


def _one_line(e: BaseException, limit: int = 200) -> str:
    return " ".join(str(e).split())[:limit]
