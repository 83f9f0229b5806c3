"""A reward model: a Hugging Face ``AutoModelForSequenceClassification`` that scores (prompt,
response) pairs in batches.

Each pair becomes one text as TRL's GRPOTrainer builds it for a reward model: the model's own
chat template applied to the conversation (the prompt's messages, or the prompt as one user
message, then the response as the assistant's) when its tokenizer has one, else the prompt
followed by the response; tokenized without added special tokens, padded on the right, the
start cut when longer than ``max_length`` (the end of the response is what is judged). The
score is the logit of label ``label_index`` at the last token (``num_labels=1``: the logit).
"""

from __future__ import annotations

from engine.errors import ConfigError
from engine.rewards.scorers import conversation, plain_text

KEY = "task.reward_model.path"


def resolve_reward_model(path: str, label_index: int = 0) -> str:
    """The local directory of ``task.reward_model.path``, checked without loading weights: a
    sequence classifier transformers builds without running code from the directory, with weight
    files that load and a ``label_index`` it has. ConfigError (exit 2) naming the fix otherwise."""
    from engine.model.source import check_model_files, check_weight_files, read_config_json, resolve_path_or_hub_id

    local = resolve_path_or_hub_id(path, key=KEY)
    raw = read_config_json(local)
    check_model_files(local, raw)
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    model_type = raw.get("model_type", "")
    if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise ConfigError(f"`{KEY}={path}`: config.json has model_type={model_type!r}, which transformers cannot "
                          f"build as a sequence classifier (AutoModelForSequenceClassification). Point it at a reward "
                          f"model saved with save_pretrained.", title="not a reward model")
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"`{KEY}={path}` is a {archs[0]}, not a sequence classifier: loaded as one, its score head "
                          f"would be freshly initialised at random and the rewards noise. Use a reward model (its "
                          f"config.json lists a *ForSequenceClassification architecture), or train one first.",
                          title="not a reward model")
    n_labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 2  # transformers' default is 2
    if label_index >= n_labels:
        raise ConfigError(f"`task.reward_model.label_index={label_index}`, but {path} has {n_labels} label(s) "
                          f"(0..{n_labels - 1}). Choose the logit that is the reward.", title="invalid config value")
    check_weight_files(local)
    return local


def load_tokenizer(local: str, path: str):
    from transformers import AutoTokenizer

    from engine.model.source import HF_LOAD_KWARGS

    try:
        tok = AutoTokenizer.from_pretrained(local, **HF_LOAD_KWARGS)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"`{KEY}={path}` has no usable tokenizer ({str(e).splitlines()[0][:200]}). Save it beside "
                          f"the model: tokenizer.save_pretrained(dir).", title="no tokenizer") from None
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"`{KEY}={path}`: the tokenizer has neither a pad nor an end-of-sequence token, so "
                              f"responses of different lengths cannot be scored in one batch. Set one and save: "
                              f"tokenizer.pad_token = '...'; tokenizer.save_pretrained(dir).", title="no pad token")
        tok.pad_token = tok.eos_token
    tok.padding_side, tok.truncation_side = "right", "left"
    return tok


class RewardModel:
    """The loaded model and tokenizer on ``device``; ``score(pairs)`` -> one float per pair."""

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32", batch_size: int = 16,
                 max_length: int = 1024, label_index: int = 0):
        import torch
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        from engine.model.source import HF_LOAD_KWARGS

        hf_logging.disable_progress_bar()  # no tqdm bar across the run's table on stderr
        local = resolve_reward_model(path, label_index)
        self.tokenizer = load_tokenizer(local, path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            local, dtype=getattr(torch, dtype), **HF_LOAD_KWARGS).to(device).eval()
        if self.model.config.pad_token_id is None:  # the classifier finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size, self.max_length, self.label_index = device, batch_size, max_length, label_index
        self.templated = getattr(self.tokenizer, "chat_template", None) is not None

    def text(self, prompt: object, response: str) -> str:
        if self.templated:
            return self.tokenizer.apply_chat_template(conversation(prompt, response), tokenize=False)
        return plain_text(prompt, response)

    def score(self, pairs: list[tuple[object, str]]) -> list[float]:
        import torch

        texts = [self.text(p, r) for p, r in pairs]
        out: list[float] = []
        with torch.inference_mode():
            for a in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[a:a + self.batch_size], return_tensors="pt", padding=True,
                                     truncation=True, max_length=self.max_length, add_special_tokens=False)
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
                out += logits[:, self.label_index].float().cpu().tolist()
        return out
