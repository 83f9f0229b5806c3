"""The decode step of a Llama-family causal LM with a preallocated KV cache, for the torch
sampler (engine/rollout/torch_sampler.py).

The prefill still runs through the model's own forward (any prompt layout, exactly as
transformers computes it); each following one-token step runs here instead: the model's own
modules (norms, projections, MLP, head, rotary embedding) called directly, keys and values
written in place into a cache sized for the whole response, and attention as two batched
matmuls per layer over the cache with an additive mask (on a CPU, q/k/v and gate/up each run as
one wider matmul). What
this skips per token is transformers' per-call machinery (output capture, mask construction, a
cache that grows by concatenation, i.e. copies the whole cache every token) and any wrapper hooks
(FSDP2's, which have nothing to do while the weights stay gathered for sampling).

Supported: decoder layers with ``self_attn.{q,k,v,o}_proj`` (biases allowed: Qwen2), optional
per-head ``q_norm``/``k_norm`` (Qwen3), grouped-query attention, any rotary scaling the model's
``rotary_emb`` implements, full attention (no sliding window), no attention-logit softcapping.
Anything else -- another architecture, a PEFT wrapper, a layer whose weights are still sharded
-- gets ``None`` from ``StaticDecode.start`` and the sampler keeps the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _decoder_parts(model):
    """(inner model, layers, lm_head) when ``model`` has the supported layout, else None."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if cfg is None or inner is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)):
        return None
    if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "final_logit_softcapping", None):
        return None
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return None
    layers, head = getattr(inner, "layers", None), getattr(model, "lm_head", None)
    if layers is None or head is None or not all(hasattr(inner, n) for n in ("embed_tokens", "norm", "rotary_emb")):
        return None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return None
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return None
    try:  # weights still sharded (a DTensor): the model's own forward gathers them, not this path
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            return None
    except ImportError:
        pass
    return inner, layers, head


def _fused(linears: list) -> tuple | None:
    """(weight, bias) of plain ``nn.Linear`` modules stacked along the output dimension, or
    None when any is something else (a LoRA layer, a quantised linear)."""
    if not all(type(m) is torch.nn.Linear for m in linears):
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None
    weight = torch.cat([m.weight for m in linears], dim=0)
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears], dim=0)
    return weight, bias


def _plain_gated_mlp(mlp) -> bool:
    """The MLP computes down(act(gate(x)) * up(x)) -- the Llama/Qwen/Mistral MLP classes."""
    return type(mlp).__name__ in {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"} and \
        all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


class StaticDecode:
    """One chunk's decode state: the KV cache of every layer as [B, kv_heads, P + N, head_dim]
    and which cache positions each row may attend to."""

    def __init__(self, model, parts, keys: list, values: list, bias: torch.Tensor, filled: int):
        self.model = model
        self.inner, self.layers, self.head = parts
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.keys, self.values = keys, values
        # [B, P + N] additive mask, added to the attention scores: 0 at prompt tokens (not padding)
        # and tokens fed so far, -inf elsewhere
        self.bias = bias
        self.filled = filled          # cache positions written
        # on a CPU, q|k|v and gate|up as one matmul each: fewer, wider matmuls, which small decode
        # batches need there (1.18x -> 1.28x rollout speed at the benchmark shape). The fused
        # weights are copies held for one rollout, so not on an accelerator, where they would
        # cost device memory and the matmuls are not the bottleneck.
        fuse = next(model.parameters()).device.type == "cpu"
        self.qkv = [_fused([ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj]) if fuse else None
                    for ly in self.layers]
        self.gate_up = [_fused([ly.mlp.gate_proj, ly.mlp.up_proj]) if fuse and _plain_gated_mlp(ly.mlp) else None
                        for ly in self.layers]

    @classmethod
    def start(cls, model, cache, attention_mask: torch.Tensor, max_new_tokens: int) -> "StaticDecode | None":
        """After the prefill: copy the prefill's cache (``cache``, transformers' DynamicCache,
        one entry per layer of [B, kv_heads, P, head_dim]) into a cache with room for
        ``max_new_tokens`` more positions; None where this path does not apply."""
        parts = _decoder_parts(model)
        layer_caches = getattr(cache, "layers", None)
        if parts is None or layer_caches is None or len(layer_caches) != len(parts[1]):
            return None
        keys, values = [], []
        for lc in layer_caches:
            k, v = getattr(lc, "keys", None), getattr(lc, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
                return None
            B, H, P, D = k.shape
            kk = k.new_empty((B, H, P + max_new_tokens, D))
            vv = v.new_empty((B, H, P + max_new_tokens, D))
            kk[:, :, :P] = k
            vv[:, :, :P] = v
            keys.append(kk)
            values.append(vv)
        B, P = attention_mask.shape
        bias = torch.full((B, P + max_new_tokens), float("-inf"), dtype=keys[0].dtype, device=attention_mask.device)
        bias[:, :P].masked_fill_(attention_mask.bool(), 0.0)
        return cls(model, parts, keys, values, bias, P)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished rows leave the batch)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.bias = self.bias.index_select(0, rows)

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def _attend(self, q: torch.Tensor, i: int, length: int, bias: torch.Tensor) -> torch.Tensor:
        """One query per row against layer ``i``'s first ``length`` cache positions: [B, heads, D].

        Two batched matmuls over (row, key/value head), the query heads that share a key/value
        head stacked as rows of one matmul, and the mask added to the scores in between. On a
        CPU this is ~2-3x faster than SDPA's kernel for a single query position (which is built
        for long query blocks), and it never copies keys/values per query head."""
        B, KV, D = q.shape[0], self.kv_heads, self.head_dim
        g = self.heads // KV
        keys = self.keys[i][:, :, :length].reshape(B * KV, length, D)       # views: rows and heads merge
        values = self.values[i][:, :, :length].reshape(B * KV, length, D)
        scores = torch.bmm(q.reshape(B * KV, g, D), keys.transpose(1, 2))   # [B*KV, g, L]
        scores = scores.view(B, KV * g, length).mul_(self.scale).add_(bias)   # the mask: one row per batch row
        return torch.bmm(scores.softmax(-1).view(B * KV, g, length), values).view(B, self.heads, D)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``tokens`` [B], ``positions`` [B, 1]); logits [B, vocab]."""
        B, t = tokens.shape[0], self.filled
        self.bias[:, t] = 0.0
        bias = self.bias[:, None, :t + 1]                             # [B, 1, L]
        x = self.inner.embed_tokens(tokens[:, None])                  # [B, 1, hidden]
        cos, sin = self.inner.rotary_emb(x, positions)                # [B, 1, head_dim]
        cos, sin = cos[:, None], sin[:, None]                         # [B, 1, 1, head_dim]
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            if self.qkv[i] is not None:
                q, k, v = F.linear(h, *self.qkv[i]).split([H * D, KV * D, KV * D], -1)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = q.view(B, 1, H, D)
            k = k.view(B, 1, KV, D)
            v = v.view(B, 1, KV, D)
            if getattr(attn, "q_norm", None) is not None:
                q = attn.q_norm(q)
            if getattr(attn, "k_norm", None) is not None:
                k = attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, heads, 1, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[i][:, :, t:t + 1] = k
            self.values[i][:, :, t:t + 1] = v
            x = x + attn.o_proj(self._attend(q, i, t + 1, bias).view(B, 1, H * D))
            h = layer.post_attention_layernorm(x)
            if self.gate_up[i] is not None:
                gate, up = F.linear(h, *self.gate_up[i]).chunk(2, dim=-1)
                x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
            else:
                x = x + layer.mlp(h)
        self.filled = t + 1
        return self.head(self.inner.norm(x))[:, -1, :]
