"""Files in each convention users bring (verl Parquet, TRL JSONL, a save_to_disk directory) and a
small real Hugging Face tokenizer with a chat template, all built offline."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QUESTIONS = [("Natalia sold 48 clips in April and half as many in May. How many clips did she sell?", "72"),
             ("Weng earns 12 dollars an hour. She worked 50 minutes. How much did she earn?", "10"),
             ("Betty needs 100 dollars. She has half. Her parents give 15. How much more does she need?", "5"),
             ("James writes 3 pages to 2 friends twice a week. How many pages a year?", "624")]
INSTRUCTION = 'Let us think step by step and output the final answer after "####".'


def verl_rows(n: int = 8) -> list[dict]:
    """gsm8k as verl's examples/data_preprocess/gsm8k.py lays it out."""
    rows = []
    for i in range(n):
        q, a = QUESTIONS[i % len(QUESTIONS)]
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "system", "content": "You are a careful solver."},
                                {"role": "user", "content": f"{q} {INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": a},
                     "extra_info": {"split": "train", "index": i, "answer": f"... #### {a}", "question": q}})
    return rows


def write_verl_parquet(path: Path, n: int = 8) -> Path:
    from datasets import Dataset

    Dataset.from_list(verl_rows(n)).to_parquet(str(path))
    return path


def trl_rows(n: int = 8) -> list[dict]:
    """TRL's conversational prompt-only layout; `solution` and `difficulty` reach the reward by name."""
    rows = []
    for i in range(n):
        q, a = QUESTIONS[i % len(QUESTIONS)]
        prompt = [{"role": "user", "content": q}]
        if i % 2:  # multi-turn history
            prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}] + prompt
        rows.append({"prompt": prompt, "solution": a, "difficulty": i % 3})
    return rows


def write_trl_jsonl(path: Path, n: int = 8) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in trl_rows(n)))
    return path


def write_saved_dataset(path: Path, n_train: int = 12, n_test: int = 4) -> Path:
    """A DatasetDict saved with save_to_disk: text prompts, answers, train/test splits."""
    from datasets import Dataset, DatasetDict

    def rows(n, off):
        return [{"question": f"{i + off}+1=", "answer": str(i + off + 1), "level": i % 2} for i in range(n)]
    DatasetDict({"train": Dataset.from_list(rows(n_train, 0)),
                 "test": Dataset.from_list(rows(n_test, 100))}).save_to_disk(str(path))
    return path


def make_chat_tokenizer(path: Path, chat_template: bool = True) -> Path:
    """A word-level tokenizer trained offline on the fixture texts, with a ChatML template (or
    none), saved as a PreTrainedTokenizerFast (loads with AutoTokenizer.from_pretrained)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [q + " " + INSTRUCTION for q, _ in QUESTIONS] + ["system user assistant Hi Hello careful solver You are"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", bos_token="<|im_start|>")
    if chat_template:
        fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return path
