"""A multi-turn conversation for chat generation: its turns rendered with the tokenizer's chat template, and the
oldest exchanges dropped when the whole no longer fits the model's context.

    conv = Conversation(tok, system="You are terse.")
    ids, dropped = conv.prompt_ids("What is 2+2?", room=block_size - max_new_tokens)
    ...generate a reply from ids...
    conv.add_exchange("What is 2+2?", reply)

Each turn's prompt is the whole conversation rendered again (system message, every kept exchange, the new user
message, then the opening of the assistant's turn), so any template works, including those that write earlier
turns differently from the last one. The system message is never dropped.
"""
from __future__ import annotations

from .chat import ChatTemplateError, render_chat
from .tokenizers import TokenizerError


class ConversationError(ValueError):
    """A message that cannot be answered: it does not fit the context, or the template refuses it."""


class Conversation:
    def __init__(self, tokenizer, system: str | None = None):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConversationError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.template = template
        self.system = system
        self.exchanges: list[tuple[str, str]] = []  # (user message, assistant reply), oldest first

    def messages(self, user: str, exchanges: list[tuple[str, str]] | None = None) -> list[dict]:
        """The messages of the next prompt: system, the exchanges (default: all kept ones), the user message."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for question, reply in self.exchanges if exchanges is None else exchanges:
            out += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        return out + [{"role": "user", "content": user}]

    def encode(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        try:
            text = render_chat(self.template, messages, bos_token=tok.bos_text, eos_token=tok.eos_text)
        except ChatTemplateError as e:
            raise ConversationError(str(e)) from None
        try:
            return tok.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        except TokenizerError as e:
            raise ConversationError(f"the message cannot be encoded with this model's tokenizer: {e}") from None

    def prompt_ids(self, user: str, room: int) -> tuple[list[int], int]:
        """Token ids of the prompt for `user`'s message, at most `room` of them, and how many of the oldest
        exchanges were left out to fit (they stay out of later prompts too). ConversationError when the message
        alone (with the system message) does not fit."""
        for dropped in range(len(self.exchanges) + 1):
            ids = self.encode(self.messages(user, self.exchanges[dropped:]))
            if len(ids) <= room:
                self.exchanges = self.exchanges[dropped:]
                return ids, dropped
        raise ConversationError(f"the message takes {len(ids)} tokens with the chat template"
                                f"{' and the system message' if self.system else ''}; the context leaves room for "
                                f"{room} (block size minus --max-new-tokens)")

    def add_exchange(self, user: str, reply: str) -> None:
        self.exchanges.append((user, reply))

    def reset(self) -> None:
        """Forget every exchange (the system message stays)."""
        self.exchanges = []


SENTINEL = "\x00reply\x00"  # stands for a reply's text when finding what the template writes after one


def end_of_turn_token(tokenizer) -> int | None:
    """The id of the single token the chat template writes right after an assistant's reply (ChatML's
    <|im_end|>, Llama-3's <|eot_id|>), or None where it writes no such token (plain text, a newline): where a
    chat reply should stop, besides the tokenizer's end-of-text tokens."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]
    try:
        text = render_chat(template, messages, bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text,
                           add_generation_prompt=False)
    except ChatTemplateError:
        return None
    if SENTINEL not in text:
        return None
    after = text.split(SENTINEL, 1)[1].split()  # the words after the reply: ["<|im_end|>"], or [] after "\n"
    if not after:
        return None
    ids = tokenizer.encode(after[0], add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
