"""The megatron-core training backend (``engine.name=megatron``).

Modules: ``cpu_shim`` (megatron-core's CUDA assumptions redirected to CPU when there is no
CUDA), ``model`` (GPTModel from a HF Llama/Qwen2 config), ``hf_convert`` (HF <-> megatron
weights with TP sharding), ``optimizer`` (AdamW over main_grad on CPU, megatron's optimizer on CUDA) and ``engine``
(``MegatronEngine``). Import ``engine.backends.megatron.engine`` explicitly: importing this
package does not import megatron-core.
"""
