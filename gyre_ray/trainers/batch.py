"""The micro-batch a trainer consumes, and next-token log-probabilities on packed / tree layouts.

A row holds tokens laid out once. Token j is predicted by the logits at column `parent_index[j]`
(its predecessor along its path): j - 1 for a plain sequence, the branch point's column in a
packed prefix tree, -1 where the token has no predecessor (its log-probability is undefined and
reported as 0). `attention_mask[b, i, k]` is True where column i may attend to column k; None
means plain causal attention per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MicroBatch:
    """Padded `(B, T)` tensors plus whatever the loss function needs in `tensors`."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent_index: torch.Tensor
    attention_mask: torch.Tensor | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_executions: int = 0
    meta: dict = field(default_factory=dict)

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy on `device`."""
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            parent_index=self.parent_index.to(device),
            attention_mask=None if self.attention_mask is None else self.attention_mask.to(device),
            tensors={k: v.to(device) for k, v in self.tensors.items()},
            num_executions=self.num_executions,
            meta=dict(self.meta),
        )


def sequential_parent_index(batch: int, length: int) -> torch.Tensor:
    """Parent index of plain left-to-right rows: column j is predicted from column j - 1."""
    idx = torch.arange(length) - 1
    return idx.unsqueeze(0).expand(batch, length).clone()


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, parent_index: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[b, j] | prefix) read from logits at column parent_index[b, j]; 0 where parent < 0.

    logits: (B, T, V); input_ids, parent_index: (B, T) -> (B, T) float32 or higher.
    """
    safe_parent = parent_index.clamp(min=0)
    picked = torch.gather(logits, 1, safe_parent.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
    logp = torch.log_softmax(
        picked.float() if picked.dtype in (torch.float16, torch.bfloat16) else picked, -1
    )
    out = torch.gather(logp, -1, input_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(parent_index >= 0, out, torch.zeros_like(out))
