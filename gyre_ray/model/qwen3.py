"""A compact Qwen3 causal LM whose parameter names and shapes equal transformers' `Qwen3ForCausalLM`.

RMSNorm, rotary position embeddings, grouped-query attention with per-head q/k RMSNorm, SwiGLU MLP,
tied or untied embeddings. `forward` takes explicit position ids, an arbitrary boolean attention
mask (tree / packed / padded rows) or a `TreeLayout` (tree rows as segments, planned without ever
forming the dense mask: `gyre_ray.model.tree_attention`) and a `KVCache` it appends to. With no mask, attention is causal
over cache + new tokens and never materialises a T x S mask for a fresh prefill, so a long
single-sequence prefill stays within memory; a mask or a past turns into one `AttentionPlan`
(`gyre_ray.model.attention`) per forward: query blocks of bounded size that skip invisible keys.
Without gradients (the engine) the projections use packed fused copies where the engine made them
(`gyre_ray.model.packed_linear`) and RMSNorm runs as one fused kernel; with gradients (the trainer)
every op is the plain one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.attention import AttentionPlan, attend, plan_attention, plan_causal
from gyre_ray.model.kv_cache import KVCache
from gyre_ray.model.packed_kv import PackedCaches
from gyre_ray.model.packed_linear import linear, packed
from gyre_ray.model.tree_attention import TreePlan, plan_tree, tree_attention
from gyre_ray.model.tree_layout import TreeLayout

# What a layer's attention follows: a dense mask, a plan built from one, a tree plan, or None (causal).
Mask = torch.Tensor | AttentionPlan | TreePlan | None


def plan_mask(
    mask: torch.Tensor | TreeLayout | None,
    rows: int,
    length: int,
    past_len: int,
    heads: int,
    device: torch.device,
) -> AttentionPlan | TreePlan:
    """The plan every layer of one forward shares, for `heads` query heads (it sizes the blocks): from
    a tree layout, a (B, T, S) bool mask, or none (causal rows of `length` new tokens after `past_len`
    cached ones). The Megatron trainer's tree core attention takes the same plans."""
    if isinstance(mask, TreeLayout):
        return plan_tree(mask, heads, device)
    if mask is None:
        return plan_causal(length, past_len, device, rows, heads)
    return plan_attention(mask.to(device), heads)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 like transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not torch.is_grad_enabled():  # inference: one fused kernel
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit position ids (computed in float32, cast to the activations' dtype)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq: torch.Tensor | None = None  # not a buffer: must stay float32 under .to(dtype)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
            self._inv_freq = 1.0 / (self.theta**exponent)
        return self._inv_freq

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # (B, 1, T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Qwen3Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps)
        self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: Mask,
        kv_cache: KVCache | PackedCaches | None,
    ) -> torch.Tensor:
        batch, t, _ = x.shape
        qkv = packed(self, "qkv")
        q, k, v = qkv.split(x) if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = self.q_norm(q.view(batch, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(batch, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        past_len = 0
        if isinstance(kv_cache, PackedCaches):  # several requests side by side, each its own cache
            kv_cache.update(self.layer_idx, k, v)
            out = kv_cache.attend(q)
        elif isinstance(mask, TreePlan):
            out = tree_attention(q, k, v, mask)
        else:
            if kv_cache is not None:
                past_len = kv_cache.length
                k, v = kv_cache.update(self.layer_idx, k, v)
            out = attend(q, k, v, mask, past_len)
        out = out.transpose(1, 2).reshape(batch, t, self.num_heads * self.head_dim)
        return linear(self, "o", self.o_proj, out)


class Qwen3MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = packed(self, "gate_up")
        gate, up = gate_up.split(x) if gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return linear(self, "down", self.down_proj, F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(args, layer_idx)
        self.mlp = Qwen3MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: Mask,
        kv_cache: KVCache | PackedCaches | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """The decoder stack (`model.*` in HF parameter names)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args.head_dim, args.rope_theta)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder + LM head; `forward(input_ids, position_ids, attention_mask, kv_cache) -> logits`."""

    def __init__(
        self, args: ModelArgs, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.args = args
        self.model = Qwen3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if dtype is not None or device is not None:
            self.to(device=device, dtype=dtype)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | TreeLayout | None = None,
        kv_cache: KVCache | PackedCaches | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (B, T, hidden); same arguments as `forward`."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        batch, t = input_ids.shape
        past_len = kv_cache.length if kv_cache is not None else 0
        if kv_cache is not None and kv_cache.num_layers and kv_cache.batch_size != batch:
            raise ValueError(f"kv_cache holds {kv_cache.batch_size} rows but input_ids has {batch}")
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + t, device=input_ids.device).expand(batch, t)
        elif tuple(position_ids.shape) != (batch, t):
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} != input_ids shape {(batch, t)}"
            )
        if isinstance(attention_mask, TreeLayout):
            if kv_cache is not None or (attention_mask.batch, attention_mask.width) != (batch, t):
                raise ValueError(
                    f"tree layout of {attention_mask.batch} rows x {attention_mask.width} columns does "
                    f"not fit input_ids {(batch, t)} (and takes no KV cache)"
                )
        elif attention_mask is not None:
            expected = (batch, t, past_len + t)
            if tuple(attention_mask.shape) != expected:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != (batch, tokens, past + tokens) "
                    f"{expected}"
                )
            if attention_mask.dtype != torch.bool:
                raise ValueError(
                    f"attention_mask must be bool (True = may attend), got {attention_mask.dtype}"
                )
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary(position_ids, x.dtype)
        mask = self._attention_plan(attention_mask, batch, t, past_len, x.device)
        for layer in self.model.layers:
            x = layer(x, rope, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(t)
        return self.model.norm(x)

    def _attention_plan(
        self, mask: torch.Tensor | TreeLayout | None, batch: int, t: int, past_len: int, device: torch.device
    ) -> Mask:
        """The mask as a plan shared by every layer, where it has blocks to skip."""
        if not isinstance(mask, TreeLayout) and (t == 1 or (mask is None and past_len == 0)):
            return mask  # one decode step, or a fresh causal prefill: one fused kernel call
        return plan_mask(mask, batch, t, past_len, self.args.num_attention_heads, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | TreeLayout | None = None,
        kv_cache: KVCache | PackedCaches | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits (B, T, V); with `logits_to_keep` = n > 0 only those of the last n tokens (B, n, V).

        attention_mask: (B, T, S) bool, True = may attend, S = cache length + T; a `TreeLayout` of
        packed tree rows (no cache); None = causal.
        position_ids: (B, T); default cache length + arange(T). New keys/values go into `kv_cache`.
        """
        hidden = self.hidden_states(input_ids, position_ids, attention_mask, kv_cache)
        if logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed hidden states (its packed copy in inference, see packed_linear)."""
        return linear(self, "lm_head", self.lm_head, hidden)


@torch.no_grad()
def init_weights(model: Qwen3ForCausalLM, seed: int, std: float = 0.02) -> Qwen3ForCausalLM:
    """Seeded random init (normal(0, std) matrices, unit norms), independent of the global RNG."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            param.copy_(values.to(param.dtype))
    return model
