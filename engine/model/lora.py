"""LoRA adapters with ``peft`` (the `lora` extra): which modules, how they are injected, and
the reference to the base model a LoRA checkpoint carries instead of the base weights.

The adapters are injected in place (``peft.inject_adapter_in_model``), so the trained model
stays the plain transformers class (same forward signature, same FSDP2 blocks) with
``q_proj`` etc. replaced by ``peft`` LoRA layers: parameter names become
``...q_proj.base_layer.weight`` (frozen) and ``...q_proj.lora_A.default.weight`` /
``lora_B`` (trained). ``PeftModel`` (export, adapter directories) sees the same names under
its ``base_model.model.`` prefix.
"""

from __future__ import annotations

import hashlib

import torch

from engine.errors import ConfigError

ADAPTER = "default"
PEFT_PREFIX = "base_model.model."
INSTALL_HINT = "pip install 'rl[lora]'"


def require_peft():
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError(f"model.lora.rank > 0 needs the 'peft' package, which is not installed. Install it with: "
                          f"{INSTALL_HINT}", title="missing package") from None


def target_modules(lora_cfg, model_type: str):
    """The configured target modules, else peft's default for this architecture, else every
    linear layer but the output head ("all-linear")."""
    if lora_cfg.target_modules:
        return list(lora_cfg.target_modules)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    return list(DEFAULTS.get(model_type) or []) or "all-linear"


def peft_config(lora_cfg, model_type: str):
    require_peft()
    from peft import LoraConfig

    return LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=target_modules(lora_cfg, model_type), bias="none", task_type="CAUSAL_LM")


def check_targets(lora_cfg, hf_config) -> None:
    """Refuse, before any rank starts, configured target modules that name no linear layer of
    the model (peft raises on the rank otherwise). The model is built on the meta device: no
    weights are read or allocated."""
    if not lora_cfg.rank or not lora_cfg.target_modules:
        return
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    modules = dict(model.named_modules())

    def named(t: str) -> list:  # peft's rule for a list entry: the module's name, or a dotted suffix of it
        return [m for n, m in modules.items() if n == t or n.endswith("." + t)]

    bad = [str(t) for t in lora_cfg.target_modules if not any(isinstance(m, kinds) for m in named(str(t)))]
    if bad:
        head = model.get_output_embeddings()
        names = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in modules.items()
                                  if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}))
        what = "; ".join(f"`{t}` is {'a module that is not a linear layer' if named(t) else 'the name of no module'}"
                         for t in bad)
        raise ConfigError(f"model.lora.target_modules={list(lora_cfg.target_modules)}: {what} in this "
                          f"{hf_config.model_type} model. Its linear layers: {names}. Or leave the list empty for "
                          f"peft's default.", title="invalid config value")


def state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over every tensor of ``model`` (names, dtypes, shapes, bytes) in name order: the
    identity of the base weights a LoRA checkpoint was trained on."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def inject(model: torch.nn.Module, lora_cfg, base_path: str, hash_weights: bool = True) -> tuple[torch.nn.Module, dict]:
    """Freeze ``model`` and add LoRA adapters in place; returns (model, base reference).
    ``hash_weights`` False (a model on the meta device, without values): no ``base_sha256``; the
    rank that read the weights has it."""
    from peft import inject_adapter_in_model

    ref = {"rank": lora_cfg.rank, "alpha": lora_cfg.alpha, "dropout": lora_cfg.dropout,
           "target_modules": target_modules(lora_cfg, model.config.model_type), "base_path": base_path,
           "base_sha256": state_dict_sha256(model) if hash_weights else None, "adapter": ADAPTER}
    cfg = peft_config(lora_cfg, model.config.model_type)
    model.requires_grad_(False)
    model = inject_adapter_in_model(cfg, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.lora.target_modules={lora_cfg.target_modules} matches no module of this "
                          f"{model.config.model_type} model. Name its linear layers (e.g. q_proj, v_proj; GPT-2: "
                          f"c_attn) or leave the list empty for peft's default.", title="invalid config value")
    return model, ref


def is_lora_layer(module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def merged_weights(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base name -> merged weight ``W + scaling * (B @ A)`` (transposed for fan_in_fan_out
    layers such as GPT-2's Conv1D) for every LoRA layer of ``model``, from ``full``: the
    gathered, unsharded tensors under ``model``'s own names. ``scaling`` and
    ``fan_in_fan_out`` are read from each peft layer, and the product uses peft's
    ``transpose``, as ``LoraLayer.get_delta_weight`` does (which cannot run on FSDP2's
    sharded DTensors)."""
    from peft.utils.other import transpose

    out = {}
    for name, mod in model.named_modules():
        if not (is_lora_layer(mod) and ADAPTER in getattr(mod, "lora_A", {})):
            continue
        a, b = full[f"{name}.lora_A.{ADAPTER}.weight"], full[f"{name}.lora_B.{ADAPTER}.weight"]
        w = full[f"{name}.base_layer.weight"]
        delta = transpose(b.float() @ a.float(), getattr(mod, "fan_in_fan_out", False)) * mod.scaling[ADAPTER]
        out[f"{name}.weight"] = (w.float() + delta).to(w.dtype)
    return out


def base_name(name: str) -> str:
    """``...q_proj.base_layer.weight`` -> ``...q_proj.weight`` (the base model's name)."""
    return name.replace(".base_layer.", ".")
