"""Architecture hyper-parameters of the Qwen3-style policy, and their HF `config.json` form.

Field names are the keys of a transformers Qwen3 `config.json`, so a config moves between gyre-ray,
transformers, SGLang and Megatron converters without a renaming table. `ModelArgs.tiny()` is the CPU
default; its token ids match the shipped default tokenizer (`gyre_ray/model/assets/tokenizer.json`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16", "float64")

# Ids of the special tokens of the shipped default tokenizer (see build_tokenizer.py).
TINY_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
TINY_VOCAB_SIZE = 8192


@dataclass
class ModelArgs:
    """Qwen3 decoder hyper-parameters (names as in HF `Qwen3Config`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def tiny(cls) -> ModelArgs:
        """The CPU default: ~1.8 M parameters, 64k context, ids of the default tokenizer."""
        return cls(
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=65536,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=TINY_SPECIAL_TOKENS.index("<|endoftext|>"),
            eos_token_id=TINY_SPECIAL_TOKENS.index("<|im_end|>"),
            pad_token_id=TINY_SPECIAL_TOKENS.index("<|endoftext|>"),
        )

    @classmethod
    def preset(cls, name: str) -> ModelArgs:
        """A named built-in architecture (only `tiny` for now)."""
        presets = {"tiny": cls.tiny}
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(presets)}")
        return presets[name]()

    def validate(self) -> None:
        """Raise ValueError naming the field when the combination cannot form a Qwen3 model."""
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelArgs.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelArgs.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelArgs.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"ModelArgs.{name}={value} is outside the vocabulary [0, {self.vocab_size})")
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"ModelArgs.torch_dtype must be one of {SUPPORTED_DTYPES}, got {self.torch_dtype!r}"
            )

    @property
    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied lm_head counts once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_hidden_layers * per_layer + h

    def to_hf_config(self) -> dict[str, Any]:
        """A transformers-loadable Qwen3 `config.json` as a dict."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
        }

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Read a Qwen3 `config.json` dict; reject features this model does not implement."""
        model_type = config.get("model_type")
        if model_type not in (None, "qwen3"):
            raise ValueError(f"config.json model_type is {model_type!r}; only 'qwen3' is supported")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [key for key in required if key not in config]
        if missing:
            raise ValueError(f"config.json lacks required key(s) {missing}")
        _reject_unsupported(config)
        heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 10_000.0))
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=_single_id(config.get("bos_token_id")),
            eos_token_id=_single_id(config.get("eos_token_id")),
            pad_token_id=_single_id(config.get("pad_token_id")),
            torch_dtype=str(dtype).replace("torch.", ""),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain field dict (for logging and JSON)."""
        return asdict(self)


def _single_id(value: Any) -> int | None:
    """HF configs may hold a list of eos ids; the first one is the model's own."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _reject_unsupported(config: dict[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={config['hidden_act']!r}; only 'silu' is supported")
    if config.get("attention_bias", False):
        raise ValueError("config.json attention_bias=true is not supported (Qwen3 has no q/k/v bias)")
    if config.get("use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true is not supported")
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json {key}.rope_type={rope_type!r}; only 'default' RoPE is supported")
