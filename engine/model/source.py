"""Where ``model.path`` points: a local Hugging Face directory, or a hub id resolved offline
from the local Hugging Face cache; and whether it is a causal LM transformers can build.

Everything here runs on the driver before a run directory exists, so a bad ``model.path``
is one ConfigError (exit 2), never a transformers traceback from inside a rank.

    resolve_path_or_hub_id("./my-gpt2")            -> "./my-gpt2" (has config.json)
    resolve_path_or_hub_id("Qwen/Qwen2.5-0.5B")    -> ~/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/<rev>
    check_architecture(path)                       -> ConfigError unless a transformers causal LM

Hub ids are never downloaded: ``huggingface_hub.snapshot_download(local_files_only=True)``
finds the snapshot ``refs/main`` (or the revision after ``@``) points at in ``HF_HUB_CACHE``.

Nothing in a model directory runs code (docs/security.md, "Model directories"): every
``from_pretrained`` in engine/ passes :data:`HF_LOAD_KWARGS` (``trust_remote_code=False``, so
an ``auto_map`` naming the directory's own .py files is never imported, and transformers never
prompts for it), and :func:`check_model_files` refuses, on the driver, a directory whose model
or tokenizer exists only as custom code, and pickled weights (``pytorch_model*.bin``) that
the restricted unpickler refuses (transformers itself loads them with ``weights_only=True``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from engine import json_safe
from engine.errors import ConfigError

# every from_pretrained of a user's model directory: files on disk only, never its custom code
HF_LOAD_KWARGS = {"local_files_only": True, "trust_remote_code": False}
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")   # what transformers/peft may torch.load from a model directory

# org/name (hub ids allow letters, digits, '-', '_', '.'), optionally @revision
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def looks_like_hub_id(text: str) -> bool:
    return bool(HUB_ID_RE.match(text)) and not text.startswith((".", "/", "~"))


def hub_cache_dir() -> str:
    """HF_HUB_CACHE, else $HF_HOME/hub, else huggingface_hub's default (read now, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_hub_id(hub_id: str) -> str:
    """The cached snapshot directory of ``hub_id`` (``org/name[@revision]``); never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = hub_id.partition("@")
    cache = hub_cache_dir()
    try:
        path = snapshot_download(repo_id, revision=revision or None, local_files_only=True, cache_dir=cache)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        path = None
    if path is None or not os.path.isfile(os.path.join(path, "config.json")):
        where = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
        rev = f" --revision {revision}" if revision else ""
        raise ConfigError(
            f"model.path={hub_id!r} is neither a local directory nor a model in the local Hugging Face cache "
            f"(looked for {where}/snapshots/<rev>/config.json; HF_HUB_CACHE={cache}). rl never downloads during "
            f"a run: fetch it first with `hf download {repo_id}{rev}` (or `huggingface-cli download "
            f"{repo_id}`) on a machine with network access, or point model.path at a directory saved with "
            f"save_pretrained.", title="model not found")
    return path


def resolve_path_or_hub_id(path: str, key: str = "model.path") -> str:
    """A local HF model directory for ``model.path`` (a directory or a cached hub id); ``key``
    names the config key in the errors (``critic.model_path`` for the critic's)."""
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise ConfigError(
                f"{key}={path!r} is a directory without config.json, so it is not a Hugging Face model "
                f"directory. Point it at a directory written by save_pretrained (config.json, *.safetensors, "
                f"tokenizer files) or at a hub id in the local cache (e.g. Qwen/Qwen2.5-0.5B).",
                title="not a model directory")
        return expanded
    if os.path.exists(expanded):
        raise ConfigError(f"{key}={path!r} is a file; it must be a Hugging Face model directory (with "
                          f"config.json) or a hub id such as Qwen/Qwen2.5-0.5B.", title="not a model directory")
    if looks_like_hub_id(path):
        return resolve_hub_id(path)
    raise ConfigError(
        f"{key}={path!r} does not exist (resolved to {os.path.abspath(expanded)}). Give a local Hugging "
        f"Face model directory, a hub id in the local cache such as Qwen/Qwen2.5-0.5B ({hub_cache_dir()}), or "
        + ("unset model.path to use a preset (model=tiny|smollm2-135m)." if key == "model.path" else
           f"unset {key} to use the default."), title="model not found")


def critic_model_dir(critic_path: str, policy_dir: str) -> str:
    """Where a rank builds the PPO critic from: ``critic.model_path`` resolved like model.path
    (checked on the driver first: engine.trainer.setup.resolve_critic_path), else the policy's."""
    return resolve_path_or_hub_id(critic_path, key="critic.model_path") if critic_path else policy_dir


def read_config_json(path: str) -> dict:
    try:
        return json_safe.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}/config.json cannot be read as JSON ({e}). Re-save the model with "
                          f"save_pretrained.", title="not a model directory") from None


def check_architecture(path: str) -> None:
    """Refuse a directory that is not a causal LM transformers can build, naming what it is and
    what to do. (What a particular engine can train is checked by engine.trainer.setup.)"""
    raw = read_config_json(path)
    check_model_files(path, raw)
    model_type = raw.get("model_type", "")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        known = ", ".join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[:12])
        raise ConfigError(
            f"{path}/config.json has model_type={model_type!r}, which transformers does not know as a causal "
            f"language model (AutoModelForCausalLM: {known}, ...). rl trains decoder-only causal LMs; check "
            f"the directory, or upgrade transformers if the architecture is newer than it.",
            title="unsupported model")
    check_decoder(path, model_type)
    check_weight_files(path)


def check_decoder(path: str, model_type: str) -> None:
    """Refuse an encoder (BERT, RoBERTa, ...) whose config leaves ``is_decoder`` off: transformers
    maps it to a causal-LM head, but that head attends both ways and keeps no KV cache, so a
    rollout could not sample from it (before: an AttributeError from inside a rank's sampler)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, **HF_LOAD_KWARGS)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{path}/config.json cannot be loaded by transformers ({str(e).splitlines()[0][:200]}). "
                          f"Re-save the model with save_pretrained.", title="not a model directory") from None
    if getattr(config, "is_decoder", None) is False:
        raise ConfigError(
            f"{path}/config.json has model_type={model_type!r}, an encoder: its causal-LM head is a decoder only "
            f"with is_decoder=true, which this config leaves off (bidirectional attention, no KV cache to sample "
            f"with). rl trains decoder-only causal LMs (Llama, Qwen, Mistral, GPT-2, ...); point model.path at "
            f"one.", title="unsupported model")


def _safetensors_problem(f: Path) -> str:
    """What is wrong with a safetensors file ("" if its header and size agree), reading its header only."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"is {size} bytes, too short to hold a safetensors header"
            n = int.from_bytes(head, "little")
            if n > min(size - 8, 100 << 20):
                return f"is cut short: its header says {n} bytes of header, the file has {size}"
            header = json_safe.loads(fh.read(n))
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return "has a header that is not valid JSON"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    from engine.checkpoint.io.safetensors import entry_problem

    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in tensors.items():
        problem = entry_problem(entry)
        if problem:
            return f"has a broken header: tensor {name!r} {problem}"
    want = 8 + n + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if size < want:
        return f"is cut short: {size} bytes of the {want} its header describes"
    return ""


def check_weight_files(path: str) -> None:
    """Refuse, on the driver, weights that cannot load: no weight file at all, a safetensors file
    cut short (an interrupted download or copy) or with a broken header, an index naming shards
    that are not there. Reads headers only (before: a SafetensorError traceback from a rank)."""
    d = Path(path)
    fix = ("Copy or download the model again (hf download <id>), or re-save it with "
           "model.save_pretrained(dir).")
    shards = sorted(f for f in d.glob("*.safetensors") if f.is_file())
    for f in shards:
        problem = _safetensors_problem(f)
        if problem:
            raise ConfigError(f"{f} {problem}; the model cannot load from it. {fix}", title="damaged model")
    for index in sorted(d.glob("*.index.json")):
        try:
            weight_map = json_safe.loads(index.read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError):
            raise ConfigError(f"{index} cannot be read as a JSON weight index. {fix}", title="damaged model") from None
        missing = sorted({str(v) for v in weight_map.values() if not (d / str(v)).is_file()})
        if missing:
            raise ConfigError(f"{index} names {len(missing)} weight file(s) that are not in {path} "
                              f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}). {fix}",
                              title="damaged model")
    if not shards and not any(f.is_file() for pattern in PICKLED_WEIGHTS for f in d.glob(pattern)):
        raise ConfigError(f"{path} has no weights (no *.safetensors or pytorch_model*.bin beside config.json). "
                          f"{fix}", title="damaged model")


def _custom_code_refusal(path: str, file: str, what: str, entry: str) -> ConfigError:
    return ConfigError(
        f"{path}/{file} needs custom code to load its {what} (auto_map: {entry}); rl never runs code from a model "
        f"directory (trust_remote_code is always off). Use a model whose architecture and tokenizer transformers "
        f"ships, or, if you trust the code, save the model and tokenizer with a standard class "
        f"(save_pretrained) into a new directory.", title="model needs custom code")


def check_model_files(path: str, raw_config: dict | None = None) -> None:
    """Refuse a model directory that could only load by running its own code, and pickled
    weight files that would run code (read through the restricted unpickler, tensors unread).
    ConfigError (exit 2) naming the file; a directory transformers loads without code passes."""
    raw = raw_config if raw_config is not None else read_config_json(path)
    auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
    if isinstance(auto_map, dict) and auto_map:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if raw.get("model_type") not in CONFIG_MAPPING_NAMES:
            raise _custom_code_refusal(path, "config.json", "model", json.dumps(auto_map)[:200])
    tok_file = Path(path, "tokenizer_config.json")
    if tok_file.is_file() and not tok_file.is_symlink() and tok_file.stat().st_size < (64 << 20):
        try:
            tok = json_safe.loads(tok_file.read_text())
        except (OSError, ValueError, RecursionError):
            tok = None  # the tokenizer loader reports an unreadable file
        if isinstance(tok, dict) and isinstance(tok.get("auto_map"), (dict, list)) and tok.get("auto_map"):
            from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

            cls = tok.get("tokenizer_class")
            known = cls is None or (isinstance(cls, str) and (  # None: the model type's own tokenizer
                tokenizer_class_from_name(cls) is not None or tokenizer_class_from_name(cls.removesuffix("Fast"))
                is not None))
            if not known:
                raise _custom_code_refusal(path, "tokenizer_config.json", "tokenizer",
                                           json.dumps(tok["auto_map"])[:200])
    from engine.errors import CheckpointError
    from engine.checkpoint.io.safe_unpickle import ZIP_MAGIC, read_torch_archive

    for pattern in PICKLED_WEIGHTS:
        for f in sorted(Path(path).glob(pattern)):
            if not f.is_file():
                continue
            try:
                with open(f, "rb") as fh:
                    if fh.read(4) != ZIP_MAGIC:
                        continue  # legacy format: transformers reads it with weights_only=True (no code)
                read_torch_archive(f, display=str(f))
            except OSError:
                continue  # unreadable: the loader names it
            except CheckpointError as e:
                raise ConfigError(f"{e.message} (A model directory's pickled weights are checked before "
                                  f"anything loads them; convert trusted weights to safetensors.)",
                                  title="unsafe model") from None


def check_vocab(path: str, tokenizer, prompts: list[list[int]]) -> None:
    """Refuse a tokenizer that makes token ids the model has no embedding for (a tokenizer from
    another model, or tokens added without resizing the embedding): the prompts' ids, pad and
    eos must all be below config.json's vocab_size (before: an IndexError traceback from a rank)."""
    raw = read_config_json(path)
    size = raw.get("vocab_size", (raw.get("text_config") or {}).get("vocab_size"))
    if not isinstance(size, int) or size <= 0:
        return
    used = [("pad token", tokenizer.pad_token_id), ("eos token", tokenizer.eos_token_id)]
    top = max((max(p) for p in prompts if p), default=-1)
    used.append(("a prompt token", top))
    bad = [(what, i) for what, i in used if i is not None and i >= size]
    if bad:
        what, i = max(bad, key=lambda t: t[1])
        raise ConfigError(
            f"{path}: the tokenizer ({tokenizer.vocab_size} tokens) makes ids the model cannot embed: {what} has id "
            f"{i}, but config.json says vocab_size={size}. The tokenizer files belong to another model, or tokens "
            f"were added without model.resize_token_embeddings(len(tokenizer)); save the matching tokenizer and "
            f"model together (save_pretrained) into the directory.", title="tokenizer does not fit the model")


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length")


def context_length(path: str) -> tuple[int | None, str]:
    """How many positions a model directory's model has, and the config.json key that says so
    ((None, "") when it names none): a prompt plus its response must fit, or a learned position
    embedding (GPT-2's ``wpe``) is indexed past its end."""
    raw = read_config_json(path)
    for where, cfg in (("", raw), ("text_config.", raw.get("text_config") or {})):
        for key in CONTEXT_KEYS:
            v = cfg.get(key) if isinstance(cfg, dict) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v, f"{path}/config.json {where}{key}"
    return None, ""
