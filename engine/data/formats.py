"""Row layouts: which column is the prompt, which the reference answer, what reaches the reward.

  text  {"prompt": "2+2=", "answer": "4", ...}            prompt text, answer column
  verl  {"prompt": [{"role": "user", "content": ...}], "data_source": ..., "reward_model":
         {"style": "rule", "ground_truth": "72"}, "extra_info": {...}}   (verl's RL layout)
  trl   {"prompt": "text" or [messages], "solution": ..., ...}  (TRL's prompt-only layout: every
         other column reaches the reward function by name; answer_key is used when present)

``auto`` picks verl when a ``reward_model`` column is present, trl when prompts are message
lists, else text. Every column other than the prompt (and the answer) is kept with the row and
reaches the reward function as a keyword argument; verl rows also get ``ground_truth``.
"""

from __future__ import annotations

from engine.errors import ConfigError
from engine.data.example import Example

FORMATS = ("text", "verl", "trl")


def _is_messages(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(m, dict) for m in v)


def detect_format(columns: list[str], first: dict, prompt_key: str) -> str:
    if "reward_model" in columns and isinstance(first.get("reward_model"), dict):
        return "verl"
    if _is_messages(first.get(prompt_key)):
        return "trl"
    return "text"


def _did_you_mean(name: str, columns: list[str]) -> str:
    import difflib

    lower = {c.lower(): c for c in columns}
    close = difflib.get_close_matches(name, columns, n=1) or \
        [lower[m] for m in difflib.get_close_matches(name.lower(), list(lower), n=1)]
    return f" Did you mean `{close[0]}`?" if close else ""


def check_columns(columns: list[str], fmt: str, prompt_key: str, answer_key: str, origin: str) -> None:
    """Refuse a prompt column the data does not have, and an answer column named explicitly (not
    the default ``answer``) that it does not have: that would train against empty answers."""
    shown = ", ".join(columns) or "none"
    if prompt_key not in columns:
        hint = _did_you_mean(prompt_key, columns)
        if not hint and "messages" in columns:
            hint = (" A `messages` column holds whole conversations (TRL's SFT layout); RL needs the prompt "
                    "alone: a `prompt` column with the messages up to the assistant's turn (TRL's "
                    "conversational prompt-only layout), or task.prompt_key=messages if the conversations end "
                    "before the assistant's reply.")
        raise ConfigError(f"{origin} has no `{prompt_key}` column (task.prompt_key).{hint} Columns: {shown}. Set "
                          f"task.prompt_key=<the prompt's column>.", title="invalid dataset")
    if fmt != "verl" and answer_key != "answer" and answer_key not in columns:
        hint = _did_you_mean(answer_key, columns)
        raise ConfigError(f"{origin} has no `{answer_key}` column (task.answer_key).{hint}"
                          f" Columns: {shown}. Set task.answer_key=<the reference answer's column>, or leave it at "
                          f"its default (`answer`, optional) when the rows have none.", title="invalid dataset")


def check_prompt(prompt, where: str, fmt: str, prompt_key: str):
    """Return the prompt if usable (non-empty text, or well-formed messages); else raise naming the row."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError(f"{where}: the prompt (`{prompt_key}`) is empty. Remove the row, or fill it in.",
                              title="invalid prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise ConfigError(f"{where}: the prompt (`{prompt_key}`) is an empty message list. Remove the row, or "
                              f"give at least one {{role, content}} message.", title="invalid prompt")
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ConfigError(f"{where}: message {j} of the prompt is {m!r:.120}; each message must be a "
                                  f"{{\"role\": ..., \"content\": ...}} object.", title="invalid prompt")
            if not isinstance(m["content"], str):
                raise ConfigError(f"{where}: message {j} ({m['role']}) has content of type "
                                  f"{type(m['content']).__name__}; only text content is supported. Flatten it to "
                                  f"a string.", title="invalid prompt")
        if not any(m["content"].strip() for m in prompt):
            raise ConfigError(f"{where}: every message of the prompt is empty.", title="invalid prompt")
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    what = "missing (null)" if prompt is None else f"of type {type(prompt).__name__} ({prompt!r:.80})"
    raise ConfigError(f"{where}: the prompt (`{prompt_key}`) is {what}; a prompt is text or a list of "
                      f"{{role, content}} messages (format {fmt}). Fix the row, or point task.prompt_key at the "
                      f"prompt column.", title="invalid prompt")


def to_examples(rows: list[dict], fmt: str, prompt_key: str, answer_key: str, origin: str) -> list[Example]:
    """Rows of one split -> Examples. ``origin`` names the split in messages ("train.parquet")."""
    out = []
    for i, row in enumerate(rows):
        where = f"{origin} row {i}"
        if prompt_key not in row:
            raise ConfigError(f"{where} has no `{prompt_key}` column (task.prompt_key). Columns: "
                              f"{', '.join(row)}.", title="invalid dataset")
        prompt = check_prompt(row[prompt_key], where, fmt, prompt_key)
        if fmt == "text" and not isinstance(prompt, str):
            raise ConfigError(f"{where}: the prompt is a message list, but task.format=text expects text. Use "
                              f"task.format=trl (or verl, or auto) for chat prompts.", title="invalid prompt")
        extra = {k: v for k, v in row.items() if k != prompt_key}
        if fmt == "verl":
            rm = row.get("reward_model")
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise ConfigError(f"{where}: verl rows carry the reference answer in reward_model.ground_truth; "
                                  f"this row's reward_model is {rm!r:.80}. Use task.format=text or trl with "
                                  f"task.answer_key=<column> for another layout.", title="invalid dataset")
            answer = rm["ground_truth"]
            extra.setdefault("ground_truth", answer)
        else:
            answer = extra.pop(answer_key, "")
        out.append(Example(prompt, "" if answer is None else answer, extra, where))
    return out
