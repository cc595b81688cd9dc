"""The gyre-ray Qwen3 model equals transformers' Qwen3ForCausalLM, and checkpoints move both ways."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a dev dependency: the reference implementation, never skipped

from gyre_ray.model import load_policy
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import load_hf, save_hf
from gyre_ray.model.config import ModelSection
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.model.tokenizer import Tokenizer

CONFIGS = {
    # tied embeddings, grouped-query attention (4 query heads share 2 kv heads)
    "tied-gqa": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # untied embeddings, plain multi-head attention, head_dim != hidden / heads
    "untied-mha": dict(num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=False),
}


def small_args(**overrides) -> ModelArgs:
    base = dict(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    base.update(overrides)
    return ModelArgs(**base)


def hf_model(args: ModelArgs):
    config = transformers.Qwen3Config(**args.to_hf_config())
    return transformers.Qwen3ForCausalLM(config).eval()


def random_ids(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_names_and_shapes_equal_transformers(name):
    args = small_args(**CONFIGS[name])
    ours = {k: tuple(v.shape) for k, v in Qwen3ForCausalLM(args).state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in hf_model(args).state_dict().items()}
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_with_same_weights(name):
    args = small_args(**CONFIGS[name])
    ours = init_weights(Qwen3ForCausalLM(args), seed=3).eval()
    theirs = hf_model(args)
    theirs.load_state_dict(ours.state_dict())
    ids = random_ids(2, 33, args.vocab_size)
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == (2, 33, args.vocab_size)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gyre_checkpoint_loads_in_transformers_with_same_logits(name, tmp_path):
    args = small_args(**CONFIGS[name])
    ours = init_weights(Qwen3ForCausalLM(args), seed=5).eval()
    save_hf(ours, args, tmp_path, tokenizer=Tokenizer.default())
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert theirs.config.tie_word_embeddings == args.tie_word_embeddings
    ids = random_ids(1, 40, args.vocab_size, seed=1)
    with torch.no_grad():
        assert torch.allclose(ours(ids), theirs(input_ids=ids).logits, atol=1e-4, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.encode("def f(x):\n    return x", add_special_tokens=False) == Tokenizer.default().encode(
        "def f(x):\n    return x"
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_checkpoint_loads_in_gyre_with_same_logits(name, tmp_path):
    args = small_args(**CONFIGS[name])
    torch.manual_seed(11)
    theirs = hf_model(args)
    theirs.save_pretrained(tmp_path)
    ours, loaded_args = load_hf(tmp_path)
    assert loaded_args.tie_word_embeddings == args.tie_word_embeddings
    assert loaded_args.num_key_value_heads == args.num_key_value_heads
    if args.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = random_ids(2, 25, args.vocab_size, seed=2)
    with torch.no_grad():
        assert torch.allclose(ours(ids), theirs(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_tied_checkpoint_stores_embeddings_once(tmp_path):
    args = small_args(tie_word_embeddings=True)
    save_hf(init_weights(Qwen3ForCausalLM(args), 0), args, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"


def test_load_rejects_checkpoint_that_does_not_match_config(tmp_path):
    args = small_args()
    save_hf(init_weights(Qwen3ForCausalLM(args), 0), args, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        load_hf(tmp_path)


def test_hf_config_round_trip_and_validation():
    args = ModelArgs.tiny()
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    assert sum(p.numel() for p in Qwen3ForCausalLM(args).parameters()) == args.num_parameters
    with pytest.raises(ValueError, match="num_key_value_heads"):
        small_args(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="eos_token_id"):
        small_args(eos_token_id=300)
    with pytest.raises(ValueError, match="model_type"):
        ModelArgs.from_hf_config({**args.to_hf_config(), "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type"):
        ModelArgs.from_hf_config(
            {**args.to_hf_config(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        )
    with pytest.raises(ValueError, match="lacks required"):
        ModelArgs.from_hf_config({"model_type": "qwen3", "vocab_size": 10})


def test_load_policy_preset_is_seeded_and_path_uses_folder(tmp_path):
    first, tokenizer, args = load_policy(ModelSection(seed=7))
    again, _, _ = load_policy(ModelSection(seed=7))
    other, _, _ = load_policy(ModelSection(seed=8))
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(first.state_dict()[w], again.state_dict()[w])
    assert not torch.equal(first.state_dict()[w], other.state_dict()[w])
    assert tokenizer.vocab_size == args.vocab_size and tokenizer.eos_id == args.eos_token_id
    save_hf(first, args, tmp_path)
    loaded, loaded_tokenizer, loaded_args = load_policy(ModelSection(path=str(tmp_path), dtype="bfloat16"))
    assert loaded.state_dict()[w].dtype == torch.bfloat16 and loaded_args.torch_dtype == "bfloat16"
    assert loaded_tokenizer.vocab_size == tokenizer.vocab_size
    assert torch.equal(loaded.state_dict()[w], first.state_dict()[w].bfloat16())
