"""Tokenizers: a character-level one built offline for built-in tasks, and an adapter over
Hugging Face tokenizers for real models. Both expose the same small surface."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    pad_token_id: int
    eos_token_id: int
    end_token_ids: tuple[int, ...]  # every token that ends a response, eos_token_id first

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """One token per character of a fixed alphabet, plus <pad>=0, <eos>=1, <unk>=2.

    ``hf()`` is the same vocabulary as a real Hugging Face tokenizer (built offline with the
    ``tokenizers`` library, wrapped in ``PreTrainedTokenizerFast``): ``save_pretrained`` writes
    tokenizer.json/tokenizer_config.json that ``AutoTokenizer.from_pretrained`` reloads with
    identical ids, so a tiny-model run exports and decodes like any other model.
    """

    SPECIALS = ("<pad>", "<eos>", "<unk>")

    def __init__(self, alphabet: str):
        chars = sorted(set(alphabet))
        self.itos = list(self.SPECIALS) + chars
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2
        self.end_token_ids = (self.eos_token_id,)
        self.vocab_size = len(self.itos)
        self._hf = None

    def hf(self):
        """This vocabulary as a ``transformers.PreTrainedTokenizerFast`` (built once)."""
        if self._hf is None:
            from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
            from transformers import PreTrainedTokenizerFast

            core = Tokenizer(models.WordLevel(dict(self.stoi), unk_token="<unk>"))
            core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char
            core.decoder = decoders.Fuse()  # join characters back without spaces
            self._hf = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>", clean_up_tokenization_spaces=False,
                                               model_max_length=1 << 30)
        return self._hf

    def save_pretrained(self, path) -> None:
        self.hf().save_pretrained(str(path))

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, self.unk_token_id) for c in text]

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if i == self.eos_token_id:
                break
            if i >= len(self.SPECIALS):
                out.append(self.itos[i])
        return "".join(out)


class HFTokenizer:
    """Adapter over a transformers tokenizer; optionally applies its chat template."""

    def __init__(self, path: str, chat_template: bool = False):
        from transformers import AutoTokenizer

        from engine.errors import ConfigError
        from engine.model.source import HF_LOAD_KWARGS

        try:
            self.tok = AutoTokenizer.from_pretrained(path, **HF_LOAD_KWARGS)
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{path} has no usable tokenizer ({str(e).splitlines()[0][:200]}). A model directory "
                              f"needs its tokenizer files (tokenizer.json or the slow tokenizer's vocab): save "
                              f"them with tokenizer.save_pretrained(dir).", title="no tokenizer") from None
        self.chat_template = chat_template and getattr(self.tok, "chat_template", None) is not None
        eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else _model_eos(path)
        if eos is None:
            raise ConfigError(f"{path}: the tokenizer has no end-of-sequence token (eos_token), and neither "
                              f"config.json nor generation_config.json names an eos_token_id, so a response "
                              f"could never end. Set it and save: tokenizer.eos_token = '<the model's end token>'; "
                              f"tokenizer.save_pretrained(dir).", title="no eos token")
        self.eos_token_id = int(eos)
        pad = self.tok.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)
        self.vocab_size = len(self.tok)
        # the tokenizer's eos, then the others the model's generation config ends on: instruct
        # models whose tokenizer names the document's end but whose turns end with another token
        # (Gemma's <end_of_turn>, Phi-3's <|end|>, Llama 3's <|eot_id|>) would otherwise never stop
        self.end_token_ids = tuple(dict.fromkeys(
            [self.eos_token_id, *(i for i in model_eos_ids(path) if i < self.vocab_size)]))

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template:
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        ids = list(ids)
        end = next((k for k, i in enumerate(ids) if i in self.end_token_ids), len(ids))
        return self.tok.decode(ids[:end], skip_special_tokens=True)


def model_eos_ids(path: str) -> list[int]:
    """The eos ids a model directory's generation_config.json names (an id or a list), else its
    config.json's; [] when neither does."""
    from engine import json_safe

    for name in ("generation_config.json", "config.json"):
        try:
            eos = json_safe.loads(Path(path, name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids = [i for i in (eos if isinstance(eos, list) else [eos])
               if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if ids:
            return ids
    return []


def _model_eos(path: str):
    """The first eos id the model directory names, else None: what generation stops on when the
    tokenizer itself names no eos token."""
    ids = model_eos_ids(path)
    return ids[0] if ids else None


def encode_prompt(tok, text: str) -> list[int]:
    return tok.encode_prompt(text) if hasattr(tok, "encode_prompt") else tok.encode(text)
