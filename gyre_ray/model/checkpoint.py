"""Save and load the policy as a Hugging Face model folder (`config.json` + safetensors).

The folder is what transformers' `Qwen3ForCausalLM.save_pretrained` writes and `from_pretrained`
reads, so checkpoints move both ways. Tied embeddings store only `model.embed_tokens.weight`;
sharded checkpoints (`model.safetensors.index.json`) load too.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from gyre_ray.model.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TIED_KEY = "lm_head.weight"

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for a config name such as "bfloat16"."""
    key = name.replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def save_hf(
    model: Qwen3ForCausalLM,
    args: ModelArgs,
    folder: str | Path,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write `config.json`, `model.safetensors` (+ tokenizer files) into `folder`; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in model.state_dict().items()
        if not (args.tie_word_embeddings and name == TIED_KEY)
    }
    dtypes = {t.dtype for t in state.values()}
    config = args.to_hf_config()
    if len(dtypes) == 1:
        config["torch_dtype"] = config["dtype"] = dtype_name(dtypes.pop())
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


def read_hf_config(folder: str | Path) -> ModelArgs:
    """ModelArgs from `folder/config.json`."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        hint = ""
        if (Path(folder) / "trainer" / CONFIG_FILE).is_file():  # a run's checkpoint folder
            hint = f" (a checkpoint: its model is {Path(folder) / 'trainer'})"
        raise FileNotFoundError(f"no {CONFIG_FILE} in model folder {folder}{hint}")
    try:
        return ModelArgs.from_hf_config(json.loads(path.read_text()))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None


def _weights_files(folder: Path) -> list[Path]:
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    index = folder / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index ({exc!r})") from None
        return [folder / shard for shard in shards]
    raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in model folder {folder}")


@contextlib.contextmanager
def _named_weights_file(path: Path) -> Iterator[None]:
    """A missing or unreadable safetensors file, said as a FileNotFoundError / ValueError naming it."""
    try:
        yield
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing (named by the model folder's index)") from None
    except Exception as exc:  # safetensors' own error type: a torn or foreign file
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from None


def read_hf_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of `folder`'s single or sharded safetensors checkpoint (a torn or missing file is a
    ValueError / FileNotFoundError naming it)."""
    state: dict[str, torch.Tensor] = {}
    for path in _weights_files(Path(folder)):
        with _named_weights_file(path):
            state.update(load_file(str(path)))
    return state


def check_hf_folder(folder: str | Path) -> None:
    """Fail fast, naming the file, when `folder` is not a loadable HF model folder: its config parses
    and every weights file's header reads (no tensor is loaded)."""
    from safetensors import safe_open

    read_hf_config(folder)
    for path in _weights_files(Path(folder)):
        with _named_weights_file(path), safe_open(str(path), framework="pt") as handle:
            handle.keys()


def load_hf(folder: str | Path, dtype: torch.dtype | str | None = None) -> tuple[Qwen3ForCausalLM, ModelArgs]:
    """Build the model from an HF folder; `dtype` None = the config's `torch_dtype`."""
    args = read_hf_config(folder)
    if dtype is None:
        dtype = dtype_from_name(args.torch_dtype)
    elif isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    state = read_hf_weights(folder)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(args)
    load_state_into(model, state, dtype=dtype, assign=True)
    args.torch_dtype = dtype_name(dtype)
    return model.eval(), args


def load_state_into(
    model: Qwen3ForCausalLM,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    assign: bool = False,
) -> None:
    """Load an HF-named state dict; a missing `lm_head.weight` is fine when embeddings are tied.

    Raises ValueError naming missing, unexpected or mis-shaped tensors.
    """
    tied = model.args.tie_word_embeddings
    state = {k: v for k, v in state.items() if not (tied and k == TIED_KEY)}
    expected = {k: v.shape for k, v in model.state_dict().items() if not (tied and k == TIED_KEY)}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    wrong = [
        f"{k}: {tuple(v.shape)} != {tuple(expected[k])}" for k, v in state.items() if v.shape != expected[k]
    ]
    if wrong:
        raise ValueError(f"checkpoint tensor shapes differ from the config: {wrong}")
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=assign)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
