"""Samples -> rows -> micro-batches (`gyre_ray.trainers.batch.MicroBatch`) for the tree GSPO loss.

Samples are placed side by side in rows of at most `row_tokens` tokens (first-fit by decreasing
size; a sample never spans rows, so a longer one gets a row of its own); rows of similar length
(within `max_row_padding`) are grouped into micro-batches of at most `micro_batch_tokens` padded
tokens. Samples in one row cannot see each other: each column sees its ancestors within its own
sample. The micro-batch's `attention_mask` is a `TreeLayout` (the rows' segments), never a dense
(B, T, T) tensor, so a row of any length costs memory linear in its segments; the model plans its
attention from it (`gyre_ray.model.tree_attention`) and skips the blocks no column sees.

`MicroBatch.tensors` holds what `gyre_ray.algo.gspo.tree_gspo_loss` reads:

| key | shape | meaning |
|---|---|---|
| `loss_mask` | (B, T) bool | model-generated tokens (each once) |
| `old_logprobs` | (B, T) float32 | behaviour logprobs from the rollout engine (0 off the mask) |
| `versions` | (B, T) int64 | policy version of each generated token (-1 elsewhere) |
| `path_mask` | (B, K, T) bool | loss tokens of each path placed in the row (K = most paths in a row) |
| `path_weights` | (B, K, T) float32 | per-path token weights; each execution's weights sum to 1 |
| `path_advantages` | (B, K) float32 | advantage of the execution that owns each path |
| `path_execution` | (B, K) int64 | index into `meta["execution_ids"]` of each path's execution (-1: none) |

`MicroBatch.num_executions` counts distinct executions; `meta["execution_ids"]` lists them;
`meta["tokens"]`, `meta["padded_tokens"]` and `meta["row_lengths"]` give the real and padded sizes.
"""

from __future__ import annotations

import torch

from gyre_ray.model.tree_layout import TreeLayout
from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.trajectory.packing import Sample


def pack_rows(samples: list[Sample], row_tokens: int) -> list[list[Sample]]:
    """First-fit-decreasing placement of samples into rows of at most `row_tokens` tokens."""
    rows: list[list[Sample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=lambda s: -s.num_tokens):
        for r, free in enumerate(room):
            if sample.num_tokens <= free:
                rows[r].append(sample)
                room[r] -= sample.num_tokens
                break
        else:
            rows.append([sample])
            room.append(row_tokens - sample.num_tokens)
    return rows


def _row_segments(row: list[Sample]) -> tuple[tuple[int, int, int], ...]:
    """The row's tree segments in row columns: each sample's, shifted to its place (samples stay apart)."""
    segments: list[tuple[int, int, int]] = []
    offset = 0
    for sample in row:
        first = len(segments)
        segments += [
            (offset + start, offset + stop, parent + first if parent >= 0 else -1)
            for start, stop, parent in sample.segments
        ]
        offset += sample.num_tokens
    return tuple(segments)


def collate(rows: list[list[Sample]]) -> MicroBatch:
    """One micro-batch of rows, right-padded to the longest row."""
    width = max(sum(s.num_tokens for s in row) for row in rows)
    k_max = max(1, max(sum(len(s.path_columns) for s in row) for row in rows))
    b = len(rows)
    input_ids = torch.zeros(b, width, dtype=torch.long)
    position_ids = torch.zeros(b, width, dtype=torch.long)
    parent_index = torch.full((b, width), -1, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    old_logprobs = torch.zeros(b, width, dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    path_mask = torch.zeros(b, k_max, width, dtype=torch.bool)
    path_weights = torch.zeros(b, k_max, width, dtype=torch.float32)
    path_advantages = torch.zeros(b, k_max, dtype=torch.float32)
    path_execution = torch.full((b, k_max), -1, dtype=torch.long)
    execution_ids: list[str] = []
    for r, row in enumerate(rows):
        offset, k = 0, 0
        for s in row:
            n = s.num_tokens
            cols = slice(offset, offset + n)
            input_ids[r, cols] = torch.tensor(s.input_ids)
            position_ids[r, cols] = torch.tensor(s.position_ids)
            parents = torch.tensor(s.parent_index)
            parent_index[r, cols] = torch.where(parents >= 0, parents + offset, parents)
            loss_mask[r, cols] = torch.tensor(s.loss_mask)
            old_logprobs[r, cols] = torch.tensor(s.old_logprobs, dtype=torch.float32)
            versions[r, cols] = torch.tensor(s.versions)
            if s.execution_id not in execution_ids:
                execution_ids.append(s.execution_id)
            for columns, weights in zip(s.path_columns, s.path_weights, strict=True):
                if columns:
                    where = torch.tensor(columns) + offset
                    path_mask[r, k, where] = True
                    path_weights[r, k, where] = torch.tensor(weights, dtype=torch.float32)
                path_advantages[r, k] = s.advantage
                path_execution[r, k] = execution_ids.index(s.execution_id)
                k += 1
            offset += n
    real = sum(s.num_tokens for row in rows for s in row)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        parent_index=parent_index,
        attention_mask=TreeLayout(width, tuple(_row_segments(row) for row in rows)),
        tensors={
            "loss_mask": loss_mask,
            "old_logprobs": old_logprobs,
            "versions": versions,
            "path_mask": path_mask,
            "path_weights": path_weights,
            "path_advantages": path_advantages,
            "path_execution": path_execution,
        },
        num_executions=len(execution_ids),
        meta={
            "execution_ids": execution_ids,
            "tokens": real,
            "padded_tokens": b * width,
            "row_lengths": [sum(s.num_tokens for s in row) for row in rows],
        },
    )


def micro_batches(
    samples: list[Sample],
    row_tokens: int,
    micro_batch_tokens: int,
    share_rows: bool = True,
    max_row_padding: float = 0.25,
) -> list[MicroBatch]:
    """Rows of samples grouped into micro-batches of at most `micro_batch_tokens` padded tokens.

    Rows are taken longest first; a row joins the current micro-batch only if it fits and is at
    least (1 - max_row_padding) as long as the micro-batch's longest row, so little compute goes to
    padding. With `share_rows=False` every sample gets a row of its own (the expanded layout, which
    the trainer may then run with plain causal attention).
    """
    if micro_batch_tokens < row_tokens:
        raise ValueError(f"micro_batch_tokens ({micro_batch_tokens}) must be >= row_tokens ({row_tokens})")
    if not 0 <= max_row_padding <= 1:
        raise ValueError(f"max_row_padding must be in [0, 1], got {max_row_padding}")
    rows = pack_rows(samples, row_tokens) if share_rows else [[s] for s in samples]
    rows.sort(key=lambda row: -sum(s.num_tokens for s in row))
    batches, current, width = [], [], 0
    for row in rows:
        length = sum(s.num_tokens for s in row)
        fits = (len(current) + 1) * width <= micro_batch_tokens
        if current and (not fits or length < (1 - max_row_padding) * width):
            batches.append(collate(current))
            current = []
        if not current:
            width = length
        current.append(row)
    if current:
        batches.append(collate(current))
    return batches
