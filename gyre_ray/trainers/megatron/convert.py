"""HF Qwen3 <-> Megatron-core parameter conversion, both ways, and tensor-parallel sharding.

Pure tensor code (no Megatron import), so it is tested on any machine. Two name tables:

| HF (`model.layers.N.` ...)            | Megatron local spec (`decoder.layers.N.` ...) | Transformer Engine spec                  |
|---------------------------------------|-----------------------------------------------|------------------------------------------|
| `input_layernorm.weight`              | `input_layernorm.weight`                      | `self_attention.linear_qkv.layer_norm_weight` |
| `self_attn.{q,k,v}_proj.weight`       | `self_attention.linear_qkv.weight` (grouped)  | same                                     |
| `self_attn.q_norm` / `k_norm`         | `self_attention.q_layernorm` / `k_layernorm`  | same                                     |
| `self_attn.o_proj.weight`             | `self_attention.linear_proj.weight`           | same                                     |
| `post_attention_layernorm.weight`     | `pre_mlp_layernorm.weight`                    | `mlp.linear_fc1.layer_norm_weight`       |
| `mlp.{gate,up}_proj.weight`           | `mlp.linear_fc1.weight` = cat(gate, up)       | same                                     |
| `mlp.down_proj.weight`                | `mlp.linear_fc2.weight`                       | same                                     |

plus `model.embed_tokens` <-> `embedding.word_embeddings`, `model.norm` <-> `decoder.final_layernorm`
and `lm_head` <-> `output_layer` (absent when embeddings are tied). `linear_qkv` holds, per query
group g, the rows [q heads of g, k of g, v of g]. Every step is a view, split or cat, so a round
trip is bit-exact.

Tensor parallelism splits column-parallel weights (qkv, fc1, embedding, output layer) along rows and
row-parallel ones (linear_proj, fc2) along columns; fc1 is split as gate and up separately, so each
rank holds cat(gate_r, up_r). Norms are replicated.
"""

from __future__ import annotations

import re

import torch

from gyre_ray.model.arch import ModelArgs

SPECS = ("local", "te")
TIED_HF_KEY = "lm_head.weight"

_GLOBAL = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
# HF layer suffix -> Megatron layer suffix, for weights that map one to one.
_LAYER_SIMPLE = {
    "local": {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
        "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
        "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    },
    "te": {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
        "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
        "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    },
}
QKV = "self_attention.linear_qkv.weight"
FC1 = "mlp.linear_fc1.weight"
# How tensor parallelism splits each Megatron weight: dim 0 (column parallel), dim 1 (row parallel),
# "glu" (fc1: gate and up split separately) or None (replicated).
_SPLIT = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    QKV: 0,
    "self_attention.linear_proj.weight": 1,
    FC1: "glu",
    "mlp.linear_fc2.weight": 1,
}
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _check_spec(spec: str) -> None:
    if spec not in SPECS:
        raise ValueError(f"unknown Megatron layer spec {spec!r}; allowed: {SPECS}")


def hf_to_megatron(
    hf: dict[str, torch.Tensor], args: ModelArgs, spec: str = "local"
) -> dict[str, torch.Tensor]:
    """Megatron-named full (unsharded) weights from an HF Qwen3 state dict."""
    _check_spec(spec)
    expected = expected_hf_keys(args)
    missing = sorted(expected - set(hf))
    unexpected = sorted(set(hf) - expected - {TIED_HF_KEY})
    if missing or unexpected:
        raise ValueError(f"HF weights do not match the config: missing {missing}, unexpected {unexpected}")
    out: dict[str, torch.Tensor] = {}
    for hf_name, mg_name in _GLOBAL.items():
        if hf_name in expected:
            out[mg_name] = hf[hf_name]
    groups, per_group, d = (
        args.num_key_value_heads,
        args.num_attention_heads // args.num_key_value_heads,
        args.head_dim,
    )
    for n in range(args.num_hidden_layers):
        src, dst = f"model.layers.{n}.", f"decoder.layers.{n}."
        for hf_suffix, mg_suffix in _LAYER_SIMPLE[spec].items():
            out[dst + mg_suffix] = hf[src + hf_suffix]
        q = hf[src + "self_attn.q_proj.weight"].reshape(groups, per_group * d, -1)
        k = hf[src + "self_attn.k_proj.weight"].reshape(groups, d, -1)
        v = hf[src + "self_attn.v_proj.weight"].reshape(groups, d, -1)
        out[dst + QKV] = torch.cat([q, k, v], dim=1).reshape(-1, args.hidden_size)
        out[dst + FC1] = torch.cat([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0)
    return out


def megatron_to_hf(
    mg: dict[str, torch.Tensor], args: ModelArgs, spec: str = "local"
) -> dict[str, torch.Tensor]:
    """HF Qwen3 state dict from Megatron-named full weights (a tied model gets no `lm_head.weight`)."""
    _check_spec(spec)
    out: dict[str, torch.Tensor] = {}
    for hf_name, mg_name in _GLOBAL.items():
        if mg_name in mg:
            out[hf_name] = mg[mg_name]
    if args.tie_word_embeddings:
        out.pop(TIED_HF_KEY, None)
    groups, per_group, d = (
        args.num_key_value_heads,
        args.num_attention_heads // args.num_key_value_heads,
        args.head_dim,
    )
    for n in range(args.num_hidden_layers):
        src, dst = f"decoder.layers.{n}.", f"model.layers.{n}."
        for hf_suffix, mg_suffix in _LAYER_SIMPLE[spec].items():
            out[dst + hf_suffix] = mg[src + mg_suffix]
        qkv = mg[src + QKV].reshape(groups, (per_group + 2) * d, -1)
        q, k, v = qkv.split([per_group * d, d, d], dim=1)
        out[dst + "self_attn.q_proj.weight"] = q.reshape(-1, args.hidden_size)
        out[dst + "self_attn.k_proj.weight"] = k.reshape(-1, args.hidden_size)
        out[dst + "self_attn.v_proj.weight"] = v.reshape(-1, args.hidden_size)
        gate, up = mg[src + FC1].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
    missing = sorted(expected_hf_keys(args) - set(out))
    if missing:
        raise ValueError(f"Megatron weights lack what the config needs: {missing[:5]}")
    return out


def expected_hf_keys(args: ModelArgs) -> set[str]:
    """HF parameter names of a Qwen3 model with `args` (no `lm_head.weight` when tied)."""
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not args.tie_word_embeddings:
        keys.add(TIED_HF_KEY)
    layer = (
        *_LAYER_SIMPLE["local"],
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
    )
    for n in range(args.num_hidden_layers):
        keys.update(f"model.layers.{n}.{suffix}" for suffix in layer)
    return keys


def split_rule(name: str) -> int | str | None:
    """How tensor parallelism splits the Megatron weight `name` (0, 1, "glu" or None = replicated)."""
    match = _LAYER_KEY.match(name)
    return _SPLIT.get(match.group(2) if match else name)


def shard(full: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s slice of full Megatron weights under tensor parallel size `tp_size`."""
    out = {}
    for name, tensor in full.items():
        rule = split_rule(name)
        if rule is None or tp_size == 1:
            out[name] = tensor
        elif rule == "glu":
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)
        else:
            if tensor.size(rule) % tp_size:
                raise ValueError(
                    f"{name}: dim {rule} of size {tensor.size(rule)} does not split {tp_size} ways"
                )
            out[name] = tensor.chunk(tp_size, dim=rule)[tp_rank].contiguous()
    return out


def merge_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full Megatron weights from every rank's slice (`shards[r]` from rank r): the inverse of `shard`."""
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        rule = split_rule(name)
        if rule is None or len(parts) == 1:
            out[name] = parts[0]
        elif rule == "glu":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[name] = torch.cat(parts, dim=rule)
    return out
