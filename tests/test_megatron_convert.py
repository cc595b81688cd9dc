"""HF Qwen3 <-> Megatron conversion (pure tensors, no megatron-core needed): bit-exact round trips
under both name tables, the grouped qkv layout, and tensor-parallel shards that merge back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_cases import hf_folder, model_args

from gyre_ray.model.checkpoint import read_hf_weights
from gyre_ray.trainers.megatron.convert import (
    hf_to_megatron,
    megatron_to_hf,
    merge_shards,
    shard,
    split_rule,
)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("spec", ["local", "te"])
def test_hf_folder_round_trip_is_bit_exact(tmp_path: Path, tied: bool, spec: str) -> None:
    args = model_args(tied)
    hf = read_hf_weights(hf_folder(tmp_path, tied))
    back = megatron_to_hf(hf_to_megatron(hf, args, spec), args, spec)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    assert ("lm_head.weight" in back) is not tied


def test_name_tables_follow_megatron_layer_specs(tmp_path: Path) -> None:
    args = model_args(tied=False)
    hf = read_hf_weights(hf_folder(tmp_path, tied=False))
    local, te = hf_to_megatron(hf, args, "local"), hf_to_megatron(hf, args, "te")
    assert "decoder.layers.1.input_layernorm.weight" in local
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in local
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert torch.equal(
        te["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
        hf["model.layers.1.post_attention_layernorm.weight"],
    )
    assert len(local) == len(te) == len(hf) - 3 * args.num_hidden_layers  # q,k,v -> qkv; gate,up -> fc1


def test_qkv_rows_are_grouped_per_query_group(tmp_path: Path) -> None:
    args = model_args(tied=True)
    hf = read_hf_weights(hf_folder(tmp_path, tied=True))
    qkv = hf_to_megatron(hf, args, "local")["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per_group = args.head_dim, args.num_attention_heads // args.num_key_value_heads
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    rows = (per_group + 2) * d
    for g in range(args.num_key_value_heads):
        block = qkv[g * rows : (g + 1) * rows]
        assert torch.equal(block[: per_group * d], q[g * per_group * d : (g + 1) * per_group * d])
        assert torch.equal(block[per_group * d : per_group * d + d], k[g * d : (g + 1) * d])
        assert torch.equal(block[per_group * d + d :], v[g * d : (g + 1) * d])


def test_tensor_parallel_shards_merge_back_exactly(tmp_path: Path) -> None:
    args = model_args(tied=False)
    full = hf_to_megatron(read_hf_weights(hf_folder(tmp_path, tied=False)), args, "local")
    shards = [shard(full, 2, r) for r in range(2)]
    merged = merge_shards(shards)
    assert all(torch.equal(merged[k], full[k]) for k in full)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = full[fc1].chunk(2)
    half = args.intermediate_size // 2
    assert torch.equal(shards[1][fc1], torch.cat([gate[half:], up[half:]]))  # each rank: its gate and up
    assert split_rule("decoder.layers.3.self_attention.linear_proj.weight") == 1
    assert split_rule("decoder.final_layernorm.weight") is None
    assert torch.equal(shards[0]["decoder.final_layernorm.weight"], full["decoder.final_layernorm.weight"])


def test_incomplete_or_unknown_weights_are_named(tmp_path: Path) -> None:
    args = model_args(tied=False)
    hf = read_hf_weights(hf_folder(tmp_path, tied=False))
    hf.pop("model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.up_proj.weight'\]"):
        hf_to_megatron(hf, args)
    with pytest.raises(ValueError, match="unknown Megatron layer spec"):
        hf_to_megatron(hf, args, "fancy")
    with pytest.raises(ValueError, match="does not split 3 ways"):
        shard({"output_layer.weight": torch.zeros(256, 4)}, 3, 0)
