"""`MegatronTrainer`: the `Trainer` interface over a Megatron-core `GPTModel` (one rank: tensor- and,
with `trainer.context_parallel_size`, context-parallel; `context_parallel.py` says how a micro-batch's
columns are split).

Weights come in and go out under HF Qwen3 names (`convert.py`), so the trainer loads the same HF
folder as the torch trainer and engines, and `state_dict` / `export_grads` / `import_grads` speak the
same names as the torch trainer's: a cell holds either one behind one interface.

Forward on a tree-packed `MicroBatch`: Megatron's embedding, then its decoder with

- RoPE from the batch's explicit `position_ids` (a branch of a packed tree restarts at its branch
  point's depth): per-token frequencies `[T, B, 1, head_dim]` built from the model's own
  `inv_freq`, which Megatron's un-fused RoPE broadcasts over heads;
- tree attention planned once per forward from the batch's `TreeLayout` (`trainer.megatron_attention`
  `tree`, the default): each layer's core attention is `tree_core.TreeCoreAttention`, which follows
  the plan (memory linear in the row); with `dense` the spec's own core attention (the local
  `DotProductAttention`, or on GPU Transformer Engine's with its "arbitrary" mask type, un-fused)
  takes the tree as an explicit `[B, 1, T, T]` mask (Megatron's convention: True = masked out).
  Packed THD kernels cannot express a tree, so they are not used.

Log-probs follow `gyre_ray.trainers.batch.token_logprobs`'s contract, so the loss is the very
`gyre_ray.algo` loss the torch trainer uses. The LM head runs only on the columns that predict a
scored token (`_target_logprobs`): in `forward_backward` those are the loss tokens alone (the model's
own outputs; an agent's trajectory is mostly prompt and tool output), in chunks of
`LOGPROB_CHUNK_TOKENS`. With tensor parallel 1 that is `batch.target_logprobs`; above it the logits
stay vocab-sharded and Megatron's `vocab_parallel_cross_entropy` reads each target's log-prob (three
all-reduces of one number per token instead of gathering the vocabulary), each chunk's logits
computed again in the backward rather than kept (as `target_logprobs` does above
`KEEP_PROBS_ELEMENTS`). Under context parallel
each rank does the same on its share of the columns, for the scored tokens whose predicting column
it holds (`context_parallel.local_parents`), and the group sums the log-probs.

Gradients: summed across calls. Megatron sums q/k-norm gradients over the tensor-parallel group in
`finalize_model_grads` (those norms see only this rank's heads); without its DDP wrapper this trainer
does the same after each backward, and under context parallelism sums every gradient of that
backward over the context-parallel group (one flat all-reduce). Norms of sharded gradients are all-reduced for clipping, so every
rank clips and steps alike. Optimizer: torch AdamW per rank (Megatron's optimizer does not run on
CPU); on GPU the same code runs, Megatron's distributed optimizer is not wired yet.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import read_hf_weights
from gyre_ray.model.qwen3 import plan_mask
from gyre_ray.model.tree_attention import plan_tree
from gyre_ray.trainers.base import LossFn, Trainer, add_grad, apply_step, make_optimizer, set_hyperparameters
from gyre_ray.trainers.batch import (
    LOGPROB_CHUNK_TOKENS,
    MicroBatch,
    batch_problem,
    dense_attention_mask,
    scored_predictors,
    target_logprobs,
)
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.megatron import build
from gyre_ray.trainers.megatron.context_parallel import SharePlan, local_parents, share_of, sum_across
from gyre_ray.trainers.megatron.convert import hf_to_megatron, megatron_to_hf, merge_shards, shard, split_rule

STATE_FILE = "trainer_state_tp{rank}.pt"


class MegatronInputError(ValueError):
    """A micro-batch, weight or gradient dict that does not fit the model (the message names the field)."""


class MegatronTrainer(Trainer):
    """One rank in this process; with tensor and context parallel 1 it is the whole trainer.

    With more ranks every rank's process constructs one and makes the same calls in the same order
    (collectives inside); `TensorParallelTrainer` or `RayTensorParallelTrainer` drives them.
    """

    def __init__(
        self,
        hf_state: dict[str, torch.Tensor],
        args: ModelArgs,
        section: TrainerSection,
        loss_fn: LossFn,
        *,
        version: int = 0,
        rank: int = 0,
        store: dist.Store | None = None,
    ) -> None:
        from megatron.core import parallel_state

        tp, cp = section.tensor_parallel_size, section.context_parallel_size
        build.init_parallel(tp, rank=rank, world_size=tp * cp, store=store, cp_size=cp)
        self.args, self.section, self.loss_fn = args, section, loss_fn
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_split = section.context_parallel_split
        self.local_heads = args.num_attention_heads // self.tp_size  # this rank's query heads
        self.spec = build.resolve_spec(section.megatron_spec)
        dtype = next(iter(hf_state.values())).dtype
        if dtype not in build.DTYPES.values():
            raise MegatronInputError(
                f"Megatron trainer: unsupported weight dtype {dtype}; use float32, bfloat16 or float16"
            )
        self.attention = section.megatron_attention
        self.model = build.build_gpt_model(args, self.spec, dtype, self.attention)
        self.params = dict(self.model.named_parameters())
        # in parameter order: every rank must issue the same collectives in the same order
        qk = ("q_layernorm.weight", "k_layernorm.weight")
        self.qk_norms = [n for n in self.params if n.endswith(qk)] if self.tp_size > 1 else []
        self._hf_shapes = {k: tuple(v.shape) for k, v in self._untied(hf_state).items()}
        self._load_hf(hf_state)
        self.optimizer, self.master = make_optimizer(self.params, section)
        self.version, self.step, self.accumulated_batches = version, 0, 0

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    # ------------------------------------------------------------------ compute
    def _logprobs(self, batch: MicroBatch, loss_only: bool = False) -> torch.Tensor:
        """(B, T) log-probs of `batch`'s tokens; `loss_only`: only its loss tokens are scored (the
        others read 0), as the torch trainer's `model_logprobs(..., loss_only=True)`."""
        if problem := batch_problem(batch, self.args.vocab_size):
            raise MegatronInputError(problem)
        batch = batch.to(self.device)
        wanted = batch.tensors.get("loss_mask") if loss_only else None
        if self.cp_size > 1:
            return self._share_logprobs(batch, wanted)
        hidden = self._hidden(batch.input_ids, batch.position_ids, self._attention_mask(batch))
        return self._target_logprobs(hidden.transpose(0, 1), batch.input_ids, batch.parent_index, wanted)

    def _hidden(self, ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any) -> torch.Tensor:
        """[T, B, H] final hidden states of columns `ids` (B, T) through embedding and decoder."""
        hidden = self.model.embedding(input_ids=ids, position_ids=position_ids)  # [T, B, H]
        return self.model.decoder(
            hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=self._rotary(position_ids)
        )

    def _output_weight(self) -> torch.Tensor | None:
        """The LM head's (local shard of the) weight when tied to the embedding; None: its own."""
        return self.model.shared_embedding_or_output_weight() if self.args.tie_word_embeddings else None

    def _target_logprobs(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        parent_index: torch.Tensor,
        wanted: torch.Tensor | None,
    ) -> torch.Tensor:
        """(B, T) log-probs of `input_ids` (B, T), each read at `parent_index`'s column of the final
        hidden states `hidden` (B, columns, H): the LM head runs on the predicting columns of the
        scored tokens only (those with a parent, and in `wanted` if given), `LOGPROB_CHUNK_TOKENS` at
        a time; 0 elsewhere."""
        weight = self._output_weight()
        if self.tp_size == 1:
            lm_head = weight if weight is not None else self.model.output_layer.weight
            return target_logprobs(hidden, lm_head, input_ids, parent_index, wanted=wanted)
        # the same tokens on every rank of the tensor-parallel group, so they make the same collectives
        rows, cols, predictors, targets = scored_predictors(hidden, input_ids, parent_index, wanted)
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
        if not targets.numel():  # (a context-parallel rank holding no scored token's predictor) tied to
            # `hidden` all the same: its backward must run the decoder's, whose collectives its peers join
            return out + hidden.sum() * 0.0
        for start in range(0, targets.numel(), LOGPROB_CHUNK_TOKENS):
            stop = min(targets.numel(), start + LOGPROB_CHUNK_TOKENS)
            chunk = (predictors[start:stop], targets[start:stop], weight)
            if torch.is_grad_enabled():  # the chunk's logits are computed again in the backward, not kept
                picked = torch.utils.checkpoint.checkpoint(
                    self._vocab_parallel_picked, *chunk, use_reentrant=False
                )
            else:
                picked = self._vocab_parallel_picked(*chunk)
            out = out.index_put((rows[start:stop], cols[start:stop]), picked)
        return out

    def _vocab_parallel_picked(
        self, predictors: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None
    ) -> torch.Tensor:
        """(n,) log-probs of `targets` from their predicting hidden states (n, H), the logits kept
        vocab-sharded over the tensor-parallel group (Megatron's `vocab_parallel_cross_entropy`)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits, _ = self.model.output_layer(predictors[:, None], weight=weight)  # [n, 1, V / tp]
        return -vocab_parallel_cross_entropy(logits, targets[:, None]).squeeze(-1)

    def _share_logprobs(self, batch: MicroBatch, wanted: torch.Tensor | None) -> torch.Tensor:
        """Context parallel: this rank runs its share of the columns and scores the tokens (in `wanted`
        if given) whose predicting column it holds; the group sums the log-probs."""
        try:
            share = share_of(batch, self.cp_size, self.cp_rank, self.cp_split)
        except ValueError as exc:
            raise MegatronInputError(str(exc)) from None
        plan = plan_tree(share.layout, self.local_heads, self.device, queries=share.ranges)
        ids = share.input_ids.index_select(1, share.columns)
        positions = share.position_ids.index_select(1, share.columns)
        hidden = self._hidden(ids, positions, SharePlan(plan, share.column_split(self.cp_group)))
        scored_here = share.padded(wanted.long(), 0) if wanted is not None else None
        mine = self._target_logprobs(
            hidden.transpose(0, 1), share.input_ids, local_parents(share), scored_here
        )
        return sum_across(mine, self.cp_group)[:, : share.length]

    def _attention_mask(self, batch: MicroBatch) -> Any:
        """What the decoder passes each layer's core attention: the micro-batch's attention plan
        (`tree_core.py`), or for `dense` the explicit [B, 1, T, T] mask (Megatron: True = masked out)."""
        if self.attention == "tree":
            rows, length = batch.input_ids.shape
            return plan_mask(batch.attention_mask, rows, length, 0, self.local_heads, self.device)
        return ~dense_attention_mask(batch)[:, None]

    def _rotary(self, position_ids: torch.Tensor) -> torch.Tensor:
        inv_freq = self.model.rotary_pos_emb.inv_freq.to(position_ids.device)
        freqs = position_ids.t().float().unsqueeze(-1) * inv_freq  # [T, B, D/2]
        return torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [T, B, 1, D]

    def forward_backward(self, batch: MicroBatch) -> dict[str, float]:
        self.model.train()
        logprobs = self._logprobs(batch, loss_only=True)
        loss, metrics = self.loss_fn(logprobs, batch.to(self.device))
        if loss.dim() != 0:
            raise MegatronInputError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
        held = self._take_partial_grads()
        loss.backward()
        self._reduce_partial_grads(held)
        self.accumulated_batches += 1
        return {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

    @torch.no_grad()
    def compute_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        self.model.eval()
        return self._logprobs(batch).cpu()

    # q/k norms are replicated but each rank's backward sees only its own heads: sum over the TP group.
    # Under context parallelism every parameter saw only this rank's columns: sum over the CP group.
    def _take_partial_grads(self) -> dict[str, torch.Tensor | None]:
        held = {}
        for name in self.params if self.cp_size > 1 else self.qk_norms:
            held[name], self.params[name].grad = self.params[name].grad, None
        return held

    def _reduce_partial_grads(self, held: dict[str, torch.Tensor | None]) -> None:
        qk_norms = set(self.qk_norms)
        fresh = []
        for name in held:
            param = self.params[name]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if name in qk_norms:
                dist.all_reduce(param.grad, group=self.tp_group)
            fresh.append(param.grad)
        if self.cp_size > 1 and fresh:  # one flat all-reduce of this backward's gradients
            flat = torch._utils._flatten_dense_tensors(fresh)
            dist.all_reduce(flat, group=self.cp_group)
            for grad, summed in zip(fresh, torch._utils._unflatten_dense_tensors(flat, fresh), strict=True):
                grad.copy_(summed)
        for name, before in held.items():
            if before is not None:
                self.params[name].grad.add_(before)

    # ------------------------------------------------------------------ gradients
    def _full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full Megatron tensors from this rank's shards (a collective when tensor parallel > 1)."""
        if self.tp_size == 1:
            return local
        per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]
        for name, tensor in local.items():
            if split_rule(name) is None:
                parts = [tensor] * self.tp_size
            else:
                parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
            for rank, part in enumerate(parts):
                per_rank[rank][name] = part
        return merge_shards(per_rank)

    def _to_hf(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = megatron_to_hf(self._full(local), self.args, self.spec)
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in hf.items()}

    def _from_hf(self, hf: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
        hf = self._untied(hf)
        missing, unknown = sorted(set(self._hf_shapes) - set(hf)), sorted(set(hf) - set(self._hf_shapes))
        if unknown:
            raise MegatronInputError(f"{what}: no parameter named {unknown[:5]} in this model")
        if missing:
            raise MegatronInputError(f"{what}: needs every parameter; missing {missing[:5]}")
        wrong = [
            f"{k}: {tuple(v.shape)} != {self._hf_shapes[k]}"
            for k, v in hf.items()
            if tuple(v.shape) != self._hf_shapes[k]
        ]
        if wrong:
            raise MegatronInputError(f"{what}: shapes differ from the model: {wrong[:5]}")
        return shard(hf_to_megatron(hf, self.args, self.spec), self.tp_size, self.tp_rank)

    def _untied(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`hf` without `lm_head.weight` when embeddings are tied (it is the embedding itself)."""
        return {k: v for k, v in hf.items() if not (self.args.tie_word_embeddings and k == "lm_head.weight")}

    def export_grads(self) -> dict[str, torch.Tensor]:
        return self._to_hf(
            {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in self.params.items()}
        )

    @torch.no_grad()
    def import_grads(self, grads: dict[str, torch.Tensor]) -> None:
        for name, grad in self._from_hf(grads, "import_grads").items():
            param = self.params[name]
            add_grad(param, grad)

    def zero_grads(self) -> None:
        for param in self.params.values():  # (the optimizer's own may be float32 master copies)
            param.grad = None
        self.accumulated_batches = 0

    @torch.no_grad()
    def _grad_norm(self) -> float:
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for name, p in self.params.items():
            if p.grad is not None:
                sq = p.grad.double().pow(2).sum().cpu()
                if split_rule(name) is None:
                    replicated += sq
                else:
                    sharded += sq
        if self.tp_size > 1:
            sharded = sharded.to(self.device)
            dist.all_reduce(sharded, group=self.tp_group)
        return math.sqrt(float(sharded) + float(replicated))

    def optimizer_step(self, scale: float) -> dict[str, float]:
        if not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise MegatronInputError(f"optimizer_step scale must be a finite number, got {scale!r}")
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        with torch.no_grad():
            for g in grads:
                g.mul_(scale)
            grad_norm = self._grad_norm()
            max_norm = self.section.grad_clip if self.section.grad_clip > 0 else math.inf
            coef = min(1.0, max_norm / (grad_norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
            if math.isfinite(grad_norm) and coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return apply_step(self, grad_norm)

    # ------------------------------------------------------------------ weights and checkpoints
    @torch.no_grad()
    def _load_hf(self, hf: dict[str, torch.Tensor]) -> None:
        local = self._from_hf(hf, "weights")
        if set(local) != set(self.params):
            raise MegatronInputError(
                f"converted weights do not cover the Megatron model: {sorted(set(self.params) ^ set(local))[:5]}"
            )
        for name, tensor in local.items():
            self.params[name].copy_(tensor.to(self.params[name].dtype))
        if getattr(self, "master", None) is not None:
            self.master.reload(self.params)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._to_hf({n: p.detach() for n, p in self.params.items()})

    def megatron_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under Megatron names (for converters and tests)."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        self._load_hf(state)
        self.version = version

    def save(self, folder: str | Path) -> Path:
        from gyre_ray.model.checkpoint import load_state_into, save_hf
        from gyre_ray.model.qwen3 import Qwen3ForCausalLM

        folder = Path(folder)
        weights = self.state_dict()  # every rank takes part in the gather
        if self.tp_rank == 0 and self.cp_rank == 0:  # context-parallel ranks hold the same weights
            with torch.device("meta"):
                model = Qwen3ForCausalLM(self.args)
            load_state_into(model, weights, assign=True)
            save_hf(model, self.args, folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "version": self.version,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        if self.master is not None:
            state["master"] = self.master.state()
        if self.cp_rank == 0:  # and the same optimizer state
            torch.save(state, folder / STATE_FILE.format(rank=self.tp_rank))
        return folder

    def load(self, folder: str | Path) -> None:
        path = Path(folder) / STATE_FILE.format(rank=self.tp_rank)
        if not path.is_file():
            raise FileNotFoundError(f"no {path.name} in {folder}: not a Megatron trainer checkpoint")
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.load_state_dict(read_hf_weights(folder), version=int(state["version"]))
        self.optimizer.load_state_dict(state["optimizer"])
        set_hyperparameters(self.optimizer, self.section)
        if self.master is not None and "master" in state:
            self.master.load(state["master"])
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.zero_grads()

    def metadata(self) -> dict[str, Any]:
        return {
            **super().metadata(),
            "backend": "megatron",
            "tensor_parallel_size": self.tp_size,
            "context_parallel_size": self.cp_size,
        }
