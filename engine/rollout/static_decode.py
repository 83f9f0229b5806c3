"""The decode step of a Llama-family causal LM with a preallocated KV cache, for the torch
sampler (engine/rollout/torch_sampler.py).

The prefill still runs through the model's own forward (any prompt layout, exactly as
transformers computes it); each following one-token step runs here instead: the model's own
weights and modules, keys and values written in place into a cache sized for the whole
response, and attention as two batched matmuls per layer over the cache with an additive mask.
What this skips per token is transformers' per-call machinery (output capture, mask
construction, a cache that grows by concatenation, i.e. copies the whole cache every token) and
any wrapper hooks (FSDP2's, which have nothing to do while the weights stay gathered for
sampling). A decode step is ~16 tensor ops a layer (it was ~40 through the modules), because on
a CPU each op's fixed cost is a large share of a one-token step:

- the rotary tables (cos, sin) for every position a row will reach are computed once, by the
  model's own ``rotary_emb``, and read per step (except rotary types that depend on the length
  reached: ``dynamic``, ``longrope``, which are still called per step);
- q and k are rotated together, as ``x * cos + swap_halves(x) * sin'`` (``sin'`` the sine with
  its first half negated: the same as transformers' ``rotate_half``);
- the Llama/Qwen/Mistral RMSNorm as one ``F.rms_norm`` in float32 (the same formula; other
  dtypes call the module);
- on a CPU q|k|v and gate|up run as one wider matmul each, and the output and down projections
  add the residual in the same call (``addmm``);
- on a CPU every projection (and the LM head) multiplies by a contiguous copy of its weight's
  transpose, [in, out], made once per rollout: a one-token step's matmuls have few rows (a lane's
  32), and MKL's kernel for ``x @ W.t()`` on the stored [out, in] weight re-reads the weight
  transposed on every call -- 1.25-1.5x slower at these shapes (1 thread, 8-32 rows, hidden
  256-1536), with the same result bit for bit at 32 rows; with oneDNN linears
  (engine/model/onednn_linear.py) each weight is instead reordered once per rollout into oneDNN's
  packed layout (``pack_weight``: 1.15-1.25x per product at a lane's 32 rows, ~5% of a rollout);
- the attention scale and mask go into the first batched matmul (``baddbmm``).

Several ``StaticDecode`` over disjoint rows of one prefill can step concurrently on separate
threads (the sampler's decode lanes): a step touches only its own cache and the weights, which
it reads.

Supported: decoder layers with ``self_attn.{q,k,v,o}_proj`` (biases allowed: Qwen2), optional
per-head ``q_norm``/``k_norm`` (Qwen3), grouped-query attention, any rotary scaling the model's
``rotary_emb`` implements, full attention (no sliding window), no attention-logit softcapping.
Anything else -- another architecture, a PEFT wrapper, a layer whose weights are still sharded
-- gets ``None`` from ``StaticDecode.start`` and the sampler keeps the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layer_kinds import is_llama_rms_norm, is_plain_gated_mlp
from engine.model.onednn_linear import onednn_matmul, pack_weight

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
PER_STEP_ROPE_TYPES = ("dynamic", "longrope")  # the tables depend on the longest position seen


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x2, x1] of x = [x1, x2] along the last dimension; with the sine's first half negated,
    ``swap_halves(x) * sin'`` is transformers' ``rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def _norm(module):
    """The RMSNorm ``module`` as a function of x: one ``F.rms_norm`` for the Llama-family class in
    float32 (the same formula: x * rsqrt(mean(x^2) + eps) * weight), else the module itself."""
    if not is_llama_rms_norm(module) or module.weight.dtype != torch.float32:
        return module
    weight, eps = module.weight, module.variance_epsilon
    shape = (weight.shape[-1],)
    return lambda x: F.rms_norm(x, shape, weight, eps) if x.dtype == torch.float32 else module(x)


def _onednn(linear) -> bool:
    """The module multiplies through oneDNN (engine/model/onednn_linear.py, engine.cpu_matmul):
    the decode step then does too, on the stored [out, in] weight."""
    return bool(getattr(linear, "_rl_onednn", False))


def _residual_linear(linear, transposed: bool, rows: int):
    """``(x, a) -> x + linear(a)`` as one matmul for a plain bias-free ``nn.Linear`` on 2-D
    inputs: oneDNN's when the module uses it (its weight packed for ``rows``-row products), else
    ``addmm`` (``transposed``: by a contiguous copy of the weight's transpose); otherwise the
    module and an add."""
    if type(linear) is torch.nn.Linear and linear.bias is None:
        if _onednn(linear):
            w = pack_weight(linear.weight, rows)
            return lambda x, a: onednn_matmul(a, w, None).add_(x)
        wt = linear.weight.t().contiguous() if transposed else linear.weight.t()
        return lambda x, a: torch.addmm(x, a, wt)
    return lambda x, a: x + linear(a)


def _head(head, transposed: bool, rows: int):
    """The LM head as a function of x: oneDNN's matmul when the module uses it (its weight packed
    for ``rows``-row products), a matmul by a contiguous copy of its weight's transpose for a
    plain bias-free ``nn.Linear`` when ``transposed``, else the module."""
    if type(head) is torch.nn.Linear and head.bias is None and _onednn(head):
        w = pack_weight(head.weight, rows)
        return lambda x: onednn_matmul(x, w, None)
    if transposed and type(head) is torch.nn.Linear and head.bias is None:
        wt = head.weight.t().contiguous()
        return lambda x: torch.mm(x, wt)
    return head


def _project(x: torch.Tensor, fused: tuple) -> torch.Tensor:
    """``x`` through a fused projection (``_fused``'s (weight, bias, onednn): weight [out, in] for
    oneDNN, else [in, out])."""
    w, bias, onednn = fused
    if onednn:
        return onednn_matmul(x, w, bias)
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


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


def _fused(linears: list, rows: int) -> tuple | None:
    """(weight, bias, onednn) of plain ``nn.Linear`` modules stacked along the output dimension:
    for oneDNN (the modules use it) the stacked [out, in] weight packed for ``rows``-row products,
    else its transpose, contiguous (``_project`` multiplies by either); None when any is
    something else (a LoRA layer, a quantised linear)."""
    if not all(type(m) is torch.nn.Linear for m in linears):
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears], dim=0)
    if all(_onednn(m) for m in linears):
        return pack_weight(torch.cat([m.weight for m in linears], dim=0), rows), bias, True
    return torch.cat([m.weight.t() for m in linears], dim=1), bias, False


class StaticDecode:
    """One set of rows' decode state: the KV cache of every layer as [B, kv_heads, P + N,
    head_dim], which cache positions each row may attend to, and the rows' rotary tables."""

    def __init__(self, model, parts, keys: list, values: list, bias: torch.Tensor, filled: int,
                 positions: torch.Tensor, max_new_tokens: int, like: "StaticDecode | None" = None):
        self.model = model
        self.inner, self.layers, self.head = parts
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.keys, self.values = keys, values
        # [B, kv_heads, 1, P + N] additive mask, added to the attention scores: 0 at prompt tokens
        # (not padding) and tokens fed so far, -inf elsewhere; one copy per key/value head, so a
        # step's slice is a view shaped for the batched matmul
        self.bias = bias
        self.filled = filled          # cache positions written
        self.start_filled = filled
        # on a CPU, q|k|v and gate|up as one matmul each: fewer, wider matmuls, which small decode
        # batches need there (1.18x -> 1.28x rollout speed at the benchmark shape), each by its
        # weight's transpose made contiguous (as the other projections and the LM head). These
        # are copies of the weights held for one rollout, so not on an accelerator, where they
        # would cost device memory and the matmuls are not the bottleneck.
        # (``like``: another decoder of the same rollout, whose fused weights this one shares)
        if like is not None:
            self.qkv, self.gate_up, self.norms = like.qkv, like.gate_up, like.norms
            self.final_norm, self.o_proj, self.down_proj = like.final_norm, like.o_proj, like.down_proj
            self.lm_head = like.lm_head
        else:
            fuse = next(model.parameters()).device.type == "cpu"
            rows = keys[0].shape[0]  # oneDNN packs the weights for products of this many rows
            self.qkv = [_fused([ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj], rows) if fuse
                        else None for ly in self.layers]
            self.gate_up = [_fused([ly.mlp.gate_proj, ly.mlp.up_proj], rows) if fuse and is_plain_gated_mlp(ly.mlp)
                            else None for ly in self.layers]
            self.norms = [(_norm(ly.input_layernorm), _norm(ly.post_attention_layernorm)) for ly in self.layers]
            self.final_norm = _norm(self.inner.norm)
            self.o_proj = [_residual_linear(ly.self_attn.o_proj, fuse, rows) for ly in self.layers]
            self.down_proj = [_residual_linear(ly.mlp.down_proj, fuse, rows) if self.gate_up[i] is not None else None
                              for i, ly in enumerate(self.layers)]
            self.lm_head = _head(self.head, fuse, rows)
        # rotary tables for every decode step: [B, N, head_dim] each (None: rotary_emb per step)
        self.cos = self.sin = None
        rope_type = str(getattr(self.inner.rotary_emb, "rope_type", "default"))
        self.positions = positions    # [B, 1]: the position the next fed token takes
        # static shapes (engine/rollout/graphed_decode.py): the cache position and decode step as
        # device tensors advanced by the step itself, attention over the whole cache; None: off
        self.t_dev = self.s_dev = None
        if not any(t in rope_type for t in PER_STEP_ROPE_TYPES):
            steps = positions + torch.arange(max_new_tokens, device=positions.device)[None, :]
            cos, sin = self.inner.rotary_emb(keys[0], steps)
            half = cos.shape[-1] // 2
            self.cos, self.sin = cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    @classmethod
    def start(cls, model, cache, attention_mask: torch.Tensor, max_new_tokens: int,
              rows: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              like: "StaticDecode | None" = None) -> "StaticDecode | None":
        """After the prefill: copy the prefill's cache (``cache``, transformers' DynamicCache,
        one entry per layer of [u, kv_heads, P, head_dim]) into a cache with room for
        ``max_new_tokens`` more positions; None where this path does not apply. ``rows`` [B]:
        the prefill row each decode row continues (default: each its own), so G samples of a
        prompt start from its one prefill; ``attention_mask`` [B, P] and ``positions`` [B, 1]
        (the next fed token's position; default: after the last prompt token) are per decode
        row. ``like``: a decoder over other rows of the same prefill, whose fused weights this
        one shares (decode lanes)."""
        parts = _decoder_parts(model) if like is None else (like.inner, like.layers, like.head)
        layer_caches = getattr(cache, "layers", None)
        if parts is None or layer_caches is None or len(layer_caches) != len(parts[1]):
            return None
        keys, values = [], []
        for lc in layer_caches:
            k, v = getattr(lc, "keys", None), getattr(lc, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
                return None
            if rows is not None:
                k, v = k.index_select(0, rows), v.index_select(0, rows)
            B, H, P, D = k.shape
            kk = k.new_empty((B, H, P + max_new_tokens, D))
            vv = v.new_empty((B, H, P + max_new_tokens, D))
            kk[:, :, :P] = k
            vv[:, :, :P] = v
            keys.append(kk)
            values.append(vv)
        B, P = attention_mask.shape
        kv_heads = keys[0].shape[1]
        bias = torch.full((B, kv_heads, 1, P + max_new_tokens), float("-inf"), dtype=keys[0].dtype,
                          device=attention_mask.device)
        bias[:, :, 0, :P].masked_fill_(attention_mask.bool()[:, None, :], 0.0)
        if positions is None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -1:] + 1
        return cls(model, parts, keys, values, bias, P, positions, max_new_tokens, like=like)

    def make_static(self) -> bool:
        """Switch to static shapes: every step then has the same shapes and reads its position
        from device tensors it advances itself, so it can be captured in a CUDA graph and replayed
        (engine/rollout/graphed_decode.py). Attention covers the whole cache, the positions not
        written yet closed by the mask. False (nothing changed) where the rotary tables depend on
        the length reached (computed per step on the host)."""
        if self.cos is None:
            return False
        for k, v in zip(self.keys, self.values):  # read under the closed mask: zeros, not whatever memory held
            k[:, :, self.filled:].zero_()             # (a nan there would survive a weight of 0)
            v[:, :, self.filled:].zero_()
        dev = self.bias.device
        self.t_dev = torch.tensor([self.filled], dtype=torch.long, device=dev)
        self.s_dev = torch.tensor([self.filled - self.start_filled], dtype=torch.long, device=dev)
        return True

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished rows leave the batch). One layer at a time, each old tensor
        dropped as its replacement is made: the cache is the rollout's largest allocation, and
        building every layer's new copy while the old list lives needed about 1.5x of it."""
        for i in range(len(self.keys)):
            self.keys[i] = self.keys[i].index_select(0, rows)
            self.values[i] = self.values[i].index_select(0, rows)
        self.bias = self.bias.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
        if self.cos is not None:
            self.cos, self.sin = self.cos.index_select(0, rows), self.sin.index_select(0, rows)

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def _attend(self, q: torch.Tensor, i: int, length: int, bias: torch.Tensor) -> torch.Tensor:
        """One query per row against layer ``i``'s first ``length`` cache positions: [B, heads * D].

        Two batched matmuls over (row, key/value head), the query heads that share a key/value
        head stacked as rows of one matmul, the scale and mask applied in the first. On a CPU this
        is ~2-3x faster than SDPA's kernel for a single query position (which is built for long
        query blocks), and it never copies keys/values per query head."""
        B, KV, D = q.shape[0], self.kv_heads, self.head_dim
        g = self.heads // KV
        keys = self.keys[i][:, :, :length].reshape(B * KV, length, D)       # views: rows and heads merge
        values = self.values[i][:, :, :length].reshape(B * KV, length, D)
        scores = torch.baddbmm(bias, q.reshape(B * KV, g, D), keys.transpose(1, 2), alpha=self.scale)
        return torch.bmm(scores.softmax(-1), values).view(B, self.heads * D)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor):
        """(cos, sin') for this step, [B, 1, head_dim] each (``sin'``: first half negated)."""
        if self.s_dev is not None:  # static shapes: the step index lives on the device
            return self.cos.index_select(1, self.s_dev), self.sin.index_select(1, self.s_dev)
        if self.cos is not None:
            s = self.filled - self.start_filled
            return self.cos[:, s, None], self.sin[:, s, None]
        cos, sin = self.inner.rotary_emb(x, positions)                # [B, 1, head_dim]
        half = cos.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row (``tokens`` [B]; ``positions`` [B, 1], default the rows' next
        positions); logits [B, vocab]."""
        B, t = tokens.shape[0], self.filled
        positions = self.positions if positions is None else positions
        static = self.t_dev is not None
        if static:  # the whole cache, the mask opened at the position this token takes
            self.bias.index_fill_(3, self.t_dev, 0.0)
            length = self.bias.shape[-1]
        else:
            self.bias[:, :, :, t] = 0.0
            length = t + 1
        bias = self.bias[:, :, :, :length].reshape(B * self.kv_heads, 1, length)   # a view
        x = self.inner.embed_tokens(tokens)                           # [B, hidden]
        cos, sin = self._rotary(x, positions)
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = self.norms[i][0](x)
            if self.qkv[i] is not None:
                qkv = _project(h, self.qkv[i])
            else:
                qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
            v = qkv[:, (H + KV) * D:].view(B, KV, D)
            if getattr(attn, "q_norm", None) is None and getattr(attn, "k_norm", None) is None:
                qk = qkv[:, :(H + KV) * D].view(B, H + KV, D)          # q and k rotated together
                qk = torch.addcmul(qk * cos, _swap_halves(qk), sin)
                q, k = qk[:, :H], qk[:, H:]
            else:                                                     # per-head norms first (Qwen3)
                q, k = qkv[:, :H * D].view(B, H, D), qkv[:, H * D:(H + KV) * D].view(B, KV, D)
                if getattr(attn, "q_norm", None) is not None:
                    q = attn.q_norm(q)
                if getattr(attn, "k_norm", None) is not None:
                    k = attn.k_norm(k)
                q = torch.addcmul(q * cos, _swap_halves(q), sin)
                k = torch.addcmul(k * cos, _swap_halves(k), sin)
            if static:
                self.keys[i].index_copy_(2, self.t_dev, k.unsqueeze(2))
                self.values[i].index_copy_(2, self.t_dev, v.unsqueeze(2))
            else:
                self.keys[i][:, :, t] = k
                self.values[i][:, :, t] = v
            x = self.o_proj[i](x, self._attend(q, i, length, bias))
            h = self.norms[i][1](x)
            if self.gate_up[i] is not None:
                gate, up = _project(h, self.gate_up[i]).chunk(2, dim=-1)
                x = self.down_proj[i](x, layer.mlp.act_fn(gate).mul_(up))
            else:
                x = x + layer.mlp(h)
        if static:  # in the graph: a replay advances these, the host's counters below do not move
            self.t_dev.add_(1)
            self.s_dev.add_(1)
        else:
            self.filled = t + 1
            self.positions = positions + 1
        return self.lm_head(self.final_norm(x))
