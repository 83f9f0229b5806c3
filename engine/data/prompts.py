"""Prompts -> token ids. Text is encoded as is (or, with ``task.chat_template=true``, as one user
message); a list of {role, content} messages is rendered with the tokenizer's chat template,
exactly as ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.

Prompts longer than ``data.max_prompt_length`` are refused, naming the longest row, or with
``data.filter_overlong_prompts=true`` dropped and counted (as verl does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError


def hf_tokenizer_of(tok):
    """The transformers tokenizer behind ``tok`` (an HFTokenizer adapter, or one itself), else None."""
    inner = getattr(tok, "tok", None)
    if inner is not None and hasattr(inner, "apply_chat_template"):
        return inner
    return tok if hasattr(tok, "apply_chat_template") else None


def has_chat_template(tok) -> bool:
    hf = hf_tokenizer_of(tok)
    return hf is not None and bool(getattr(hf, "chat_template", None))


def render_messages(tok, messages: list[dict], where: str) -> list[int]:
    if not has_chat_template(tok):
        what = "the tiny model's character tokenizer" if hf_tokenizer_of(tok) is None else "this tokenizer"
        raise ConfigError(f"{where}: the prompt is a list of chat messages, but {what} has no chat template to "
                          f"render them with. Use a model whose tokenizer has one (model=smollm2-135m, or "
                          f"model.path=<HF dir with a chat_template>), or give text prompts.",
                          title="no chat template")
    ids = hf_tokenizer_of(tok).apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older transformers / BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def encode_prompt(tok, prompt, *, chat_template: bool = False, where: str = "prompt") -> list[int]:
    if isinstance(prompt, list):
        return render_messages(tok, prompt, where)
    if not isinstance(prompt, str):  # formats.check_prompt refuses these for datasets; built-ins never make them
        raise ConfigError(f"{where}: the prompt is a {type(prompt).__name__}, not text or chat messages.",
                          title="invalid prompt")
    if chat_template:
        if not has_chat_template(tok):
            raise ConfigError("task.chat_template=true, but the tokenizer has no chat template. Set "
                              "task.chat_template=false, or use a model whose tokenizer has one.",
                              title="no chat template")
        return render_messages(tok, [{"role": "user", "content": prompt}], where)
    return list(tok.encode(prompt))


@dataclass
class EncodedSplit:
    ids: list[list[int]]
    examples: list                 # the examples kept, parallel to ids
    dropped: list = field(default_factory=list)   # (origin, length) of prompts dropped as overlong


def encode_split(tok, examples: list, *, split: str, max_len: int, filter_overlong: bool,
                 chat_template: bool) -> EncodedSplit:
    ids, kept, over = [], [], []
    for i, ex in enumerate(examples):
        where = getattr(ex, "origin", "") or f"{split} prompt {i}"
        p = encode_prompt(tok, ex.prompt, chat_template=chat_template, where=where)
        if len(p) > max_len:
            over.append((where, len(p)))
            if filter_overlong:
                continue
        ids.append(p)
        kept.append(ex)
    if over and not filter_overlong:
        where, longest = max(over, key=lambda t: t[1])
        raise ConfigError(f"{len(over)} {split} prompts are longer than data.max_prompt_length={max_len} tokens "
                          f"(longest: {where}, {longest} tokens). Raise data.max_prompt_length (e.g. "
                          f"data.max_prompt_length={longest}), shorten the prompts, or set "
                          f"data.filter_overlong_prompts=true to drop them (the plan shows how many).",
                          title="prompt too long")
    return EncodedSplit(ids, kept, over if filter_overlong else [])
