"""`rl export`: an rl checkpoint (FSDP2 of any world size, or Megatron at any TP) to a Hugging
Face model directory that transformers, vLLM and evaluation harnesses load.

    from engine.export import export_checkpoint
    result = export_checkpoint("ckpt/", out=None, dtype="bfloat16")   # -> ckpt/step_N/hf/

Modules, one concept each: ``locate`` (which step directory, refusals), ``base_model`` (the
config, generation config and tokenizer the checkpoint was trained from), ``weights`` (read
only the model entries of the DCP checkpoint, shard by shard, into safetensors),
``staging`` (write into a temporary directory, rename into place), ``lora`` (merge or keep
PEFT adapters), ``result`` (what the CLI renders), ``run`` (the steps in order).
"""

from engine.export.run import export_checkpoint

__all__ = ["export_checkpoint"]
