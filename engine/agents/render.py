"""Messages -> the tokens appended after a model turn, as the chat template renders them.

The model's own tokens are never re-tokenized: the context is the prompt, then each turn's
sampled ids, then each environment message's tokens. Those are the template's *delta*: a fixed
conversation rendered with and without the new messages; the text the template puts after the
end-of-turn token (Qwen: a newline) is part of the delta, since the model's turn stopped at it.
"""

from __future__ import annotations


class ChatRenderer:
    def __init__(self, hf_tokenizer, tool_schemas: list[dict] | None, end_token_ids: tuple[int, ...] = ()):
        self.tok, self.tools = hf_tokenizer, tool_schemas or None
        # the texts a model turn can end with: eos, and the model's other end tokens (Gemma's
        # <end_of_turn>: its template ends a turn with that, never with <eos>)
        ends = [self.tok.eos_token] + [self.tok.convert_ids_to_tokens(i) for i in end_token_ids]
        self.ends = [e for e in dict.fromkeys(ends) if isinstance(e, str) and e]

    def _text(self, messages, add_generation_prompt):
        return self.tok.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(self._text(messages, True), add_special_tokens=False)

    def delta(self, new_messages: list[dict]) -> list[int]:
        fixed = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        base, full = self._text(fixed, False), self._text(fixed + new_messages, True)
        if not full.startswith(base):
            raise ValueError("the chat template renders earlier messages differently once new ones follow; "
                             "its tool messages cannot be appended as a delta")
        at = max(((base.rindex(e), e) for e in self.ends if e in base), default=None)  # the turn's end
        tail = base[at[0] + len(at[1]):] if at is not None else ""
        return self.tok.encode(tail + full[len(base):], add_special_tokens=False)


class PlainRenderer:
    """No chat template (the built-in character tokenizer): a message is its content as text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def prompt(self, messages: list[dict]) -> list[int]:
        return list(self.tok.encode("".join(m["content"] for m in messages)))

    def delta(self, new_messages: list[dict]) -> list[int]:
        return list(self.tok.encode("".join(m["content"] for m in new_messages)))


def make_renderer(tokenizer, tool_schemas: list[dict] | None):
    from engine.data.prompts import has_chat_template, hf_tokenizer_of

    if has_chat_template(tokenizer):
        return ChatRenderer(hf_tokenizer_of(tokenizer), tool_schemas, getattr(tokenizer, "end_token_ids", ()))
    return PlainRenderer(tokenizer)
