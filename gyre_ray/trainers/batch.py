"""The micro-batch a trainer consumes, and next-token log-probabilities on packed / tree layouts.

A row holds tokens laid out once. Token j is predicted by the logits at column `parent_index[j]`
(its predecessor along its path): j - 1 for a plain sequence, the branch point's column in a
packed prefix tree, -1 where the token has no predecessor (its log-probability is undefined and
reported as 0). `attention_mask` says which columns each column may attend to: a (B, T, T) bool
tensor (`[b, i, k]` True where column i may attend to column k), a `TreeLayout` (packed tree rows
as segments, what the trajectory packer hands out: a few bytes where the tensor takes T^2), or
None for plain causal attention per row. `dense_attention_mask` gives the tensor in every case.

`token_logprobs` reads them from full logits; `target_logprobs` computes them from the final
hidden states and the LM head in chunks of tokens, never forming the whole (B, T, V) logits, their
gathered copy or their log-softmax (what the trainer uses; same values and gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gyre_ray.model.tree_layout import TreeLayout


@dataclass
class MicroBatch:
    """Padded `(B, T)` tensors plus whatever the loss function needs in `tensors`."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent_index: torch.Tensor
    attention_mask: torch.Tensor | TreeLayout | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_executions: int = 0
    meta: dict = field(default_factory=dict)

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy on `device`."""
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            parent_index=self.parent_index.to(device),
            attention_mask=(
                self.attention_mask.to(device)
                if isinstance(self.attention_mask, torch.Tensor)
                else self.attention_mask
            ),
            tensors={k: v.to(device) for k, v in self.tensors.items()},
            num_executions=self.num_executions,
            meta=dict(self.meta),
        )


def batch_problem(batch: MicroBatch, vocab_size: int) -> str | None:
    """What makes `batch` unfit for a model of `vocab_size` tokens (the message names the field), or
    None: every trainer checks this before it runs a micro-batch."""
    ids = batch.input_ids
    if ids.dim() != 2:
        return f"input_ids must be (batch, tokens), got shape {tuple(ids.shape)}"
    for name in ("position_ids", "parent_index"):
        if tuple(getattr(batch, name).shape) != tuple(ids.shape):
            return f"{name} shape {tuple(getattr(batch, name).shape)} != input_ids {tuple(ids.shape)}"
    mask = batch.attention_mask
    if isinstance(mask, TreeLayout):
        if (mask.batch, mask.width) != tuple(ids.shape):
            return f"tree layout of {mask.batch} rows x {mask.width} columns != input_ids {tuple(ids.shape)}"
    elif mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (*ids.shape, ids.size(1))):
        return f"attention_mask must be bool (batch, tokens, tokens), got {mask.dtype} {tuple(mask.shape)}"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return f"input_ids hold ids outside the vocabulary [0, {vocab_size})"
    columns = torch.arange(ids.size(1), device=batch.parent_index.device)
    if bool((batch.parent_index >= columns).any()):
        return "parent_index[b, j] must be < j (a token is predicted from an earlier column)"
    return None


def dense_attention_mask(batch: MicroBatch) -> torch.Tensor:
    """(B, T, T) bool: True where a column may attend to a column (causal rows when the batch has none)."""
    mask = batch.attention_mask
    if isinstance(mask, TreeLayout):
        return mask.dense(batch.input_ids.device)
    if mask is None:
        b, t = batch.input_ids.shape
        return torch.ones(t, t, dtype=torch.bool, device=batch.input_ids.device).tril().expand(b, t, t)
    return mask


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


# Tokens per chunk of `target_logprobs`: bounds the (chunk, V) logits alive at once.
LOGPROB_CHUNK_TOKENS = 1024
# Keep each chunk's probabilities for the backward pass (no LM-head recompute) up to this many floats.
KEEP_PROBS_ELEMENTS = 1 << 26


class _ChunkedTargetLogprob(torch.autograd.Function):
    """log softmax(h @ W^T)[target] per row of h (N, H), in chunks of rows; exact gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
        keep = hidden.size(0) * weight.size(0) <= KEEP_PROBS_ELEMENTS
        out = hidden.new_empty(hidden.size(0), dtype=torch.promote_types(hidden.dtype, torch.float32))
        probs = []
        for start in range(0, hidden.size(0), chunk):
            stop = min(hidden.size(0), start + chunk)
            logits = (hidden[start:stop] @ weight.t()).to(out.dtype)
            lse = torch.logsumexp(logits, -1)
            out[start:stop] = logits.gather(-1, targets[start:stop, None]).squeeze(-1) - lse
            if keep:
                probs.append(logits.sub_(lse[:, None]).exp_())
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk, ctx.probs, ctx.lse = chunk, probs, None if keep else out
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for index, start in enumerate(range(0, hidden.size(0), ctx.chunk)):
            stop = min(hidden.size(0), start + ctx.chunk)
            g = grad_out[start:stop]
            live = g.nonzero().squeeze(-1)  # tokens outside the loss have zero gradient: skip them
            if live.numel() == 0:
                continue
            rows = slice(None) if live.numel() == stop - start else live  # all live: no gather
            h, tg, g = hidden[start:stop][rows], targets[start:stop][rows], g[rows, None]
            if ctx.probs:
                probs = ctx.probs[index][rows]
            else:  # recompute: softmax = exp(logits - lse), lse = logits[target] - logprob
                logits = (h @ weight.t()).to(grad_out.dtype)
                lse = logits.gather(-1, tg[:, None]) - ctx.lse[start:stop][rows, None]
                probs = logits.sub_(lse).exp_()
            grad_logits = probs.mul_(-g)  # d logprob / d logits = onehot(target) - softmax
            grad_logits.scatter_add_(-1, tg[:, None], g)
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop][rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h)
        ctx.probs = None
        return grad_hidden, grad_weight, None, None


def target_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    parent_index: torch.Tensor,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    wanted: torch.Tensor | None = None,
) -> torch.Tensor:
    """`token_logprobs` from final hidden states (B, T, H) and the LM head weight (V, H), in chunks.

    Only the predicting columns' hidden states are gathered (B x T x H, not x V); each chunk's
    logits live only inside the chunk. `wanted` (B, T) bool: score only those tokens (a loss's
    mask: the LM head then runs on them alone). Returns (B, T) float32 or higher, 0 where parent < 0
    or not wanted.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    rows, cols, predictors, targets = scored_predictors(hidden, input_ids, parent_index, wanted)
    picked = _ChunkedTargetLogprob.apply(predictors, lm_head_weight, targets, chunk_tokens)
    out = picked.new_zeros(input_ids.shape)
    out[rows, cols] = picked
    return out


def scored_predictors(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    parent_index: torch.Tensor,
    wanted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens to score (those with a parent, and in `wanted` if given) as (rows, cols), their
    predicting columns' hidden states (N, H) and their ids (N,): what an LM head needs to read
    their log-probs from hidden states `hidden` (B, T, H)."""
    scored = parent_index >= 0
    if wanted is not None:
        scored = scored & wanted.to(scored.device, torch.bool)
    rows, cols = scored.nonzero(as_tuple=True)
    return rows, cols, hidden[rows, parent_index[rows, cols]], input_ids[rows, cols]


def model_logprobs(model: torch.nn.Module, batch: MicroBatch, loss_only: bool = False) -> torch.Tensor:
    """Per-token log-probs (B, T) of `batch` under `model` (a gyre-ray Qwen3ForCausalLM or any model
    returning logits); the chunked path where the model exposes `hidden_states` and `lm_head`.
    `loss_only`: only the tokens of `batch.tensors["loss_mask"]` are scored, the others read 0 (on
    the chunked path the LM head then runs on the loss tokens alone: in an agent's trajectory most
    tokens are prompt and tool output, which the loss never reads)."""
    inputs = (batch.input_ids, batch.position_ids, batch.attention_mask)
    wanted = batch.tensors.get("loss_mask") if loss_only else None
    if hasattr(model, "hidden_states") and hasattr(model, "lm_head"):
        hidden = model.hidden_states(*inputs)
        return target_logprobs(
            hidden, model.lm_head.weight, batch.input_ids, batch.parent_index, wanted=wanted
        )
    out = token_logprobs(model(*inputs), batch.input_ids, batch.parent_index)
    return out if wanted is None else torch.where(wanted.bool(), out, torch.zeros_like(out))
