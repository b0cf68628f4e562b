"""One training run of the convergence benchmark: a TinyLM from scratch over one ordering's steps.

`run_job(config, ordering, seed)` reads the corpus, builds the seed's document stream and
global batches, asks `_converge_plans.ordering_steps` for the ordering's step plans, and trains
`wlb_opt.executor.TinyLM` on them with `train_step` in one process (no mesh: every micro-batch
runs whole, attention document-masked, the loss of a step divided by the target tokens of the
step's global batch). What is the same for every ordering of one seed: the model's initial
weights (`torch.manual_seed(seed)` right before it is built), the stream of documents (shuffled
with the seed), the global batches, AdamW and its learning-rate schedule (a function of the
step index alone), gradient clipping, and the held-out documents. What differs is only which
documents each step holds and how they are packed (see `_converge_plans`).

Held-out loss: the held-out files' documents (epoch 0: each file's first bytes, at the same
lengths as training), packed once into fixed-length micro-batches, evaluated without gradient
before the first step, every `eval_every` steps and after each of the last FINAL_EVALS steps. With
document-masked attention and per-document positions the value does not depend on how the
held-out documents are packed (up to float rounding).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from ..cost import CostModel
from ..documents import split_documents
from ..specs import HardwareSpec, ModelSpec, ParallelSpec
from ..step_pack import solve_pack
from . import _converge_plans as plans_mod
from .corpus import TextCorpus, read_corpus


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvergeConfig:
    """The setting of a convergence run (every ordering and seed of one run shares it)."""

    window: int = 512
    """Context length in tokens (bytes); the corpus lengths are scaled to it."""
    n_micro: int = 8
    """Micro-batches per step (N)."""
    steps: int = 192
    """Global batches fed (a multiple of the fixed-8 pool); an ordering may train a few more steps."""
    fill: float = 0.9
    """Tokens per global batch / (n_micro x window): below 1 so that fixed-length packing of one
    batch fits it and "single" reorders nothing."""
    dim: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    lr: float = 3e-3
    """Peak AdamW learning rate: linear warm-up over `warmup` steps, cosine to lr x min_lr_ratio at `steps`."""
    warmup: int | None = None
    """Warm-up steps (None: steps // 16)."""
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    """Gradient-norm clip."""
    eval_every: int = 16
    corpus: str | None = None
    """Corpus folder (None: this interpreter's standard library)."""

    def __post_init__(self) -> None:
        for name in ("window", "n_micro", "steps", "dim", "layers", "heads", "kv_heads", "ffn", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.steps % plans_mod.FIXED_POOL:
            raise ValueError(f"steps must be a multiple of {plans_mod.FIXED_POOL} (the fixed-8 pool), got {self.steps}")
        if self.window < 8:
            raise ValueError(f"window must be >= 8 tokens, got {self.window}")
        if not 0.1 <= self.fill <= 1.0:
            raise ValueError(f"fill must be in [0.1, 1.0], got {self.fill!r}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.weight_decay >= 0 and self.clip > 0):
            raise ValueError(f"need lr > 0, 0 <= min_lr_ratio <= 1, weight_decay >= 0, clip > 0; got lr={self.lr}, "
                             f"min_lr_ratio={self.min_lr_ratio}, weight_decay={self.weight_decay}, clip={self.clip}")
        if self.warmup is not None and (isinstance(self.warmup, bool) or not isinstance(self.warmup, int)
                                        or not 0 <= self.warmup < self.steps):
            raise ValueError(f"warmup must be None or an integer in [0, steps), got {self.warmup!r}")
        self.model_spec()  # heads / kv_heads / dim consistency, with ModelSpec's messages

    @property
    def tokens_per_batch(self) -> int:
        return int(self.fill * self.n_micro * self.window)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(name="converge", hidden=self.dim, layers=self.layers, heads=self.heads,
                         kv_heads=self.kv_heads, ffn=self.ffn, vocab=256)

    def cost(self) -> CostModel:
        """The cost model of the trained model at its window (fp32 CPU host, no parallelism):
        what the packers balance and what the reported PP imbalance is measured with."""
        return CostModel.analytic(self.model_spec(), ParallelSpec(), HardwareSpec.preset("cpu"))

    @property
    def warmup_steps(self) -> int:
        return self.steps // 16 if self.warmup is None else self.warmup

    def lr_at(self, step: int) -> float:
        """Learning rate of `step` (0-based); steps past `steps` (drain steps) keep the final rate."""
        warmup = self.warmup_steps
        if step < warmup:
            return self.lr * (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, self.steps - warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FINAL_EVALS = plans_mod.FIXED_POOL
"""The held-out loss is also evaluated after each of the last FINAL_EVALS steps, and the
"final" held-out loss is their mean: fixed-8's steps change composition with their place in
a pool (its first step holds the longest documents, its last the shortest), so one
evaluation after the last step would measure where in a pool the run stopped."""

_CORPUS_CACHE: dict[tuple, TextCorpus] = {}


def load_corpus(config: ConvergeConfig) -> TextCorpus:
    """The corpus at the config's window, read once per process."""
    key = (config.corpus, config.window)
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE[key] = read_corpus(config.corpus, config.window)
    return _CORPUS_CACHE[key]


def seed_stream(config: ConvergeConfig, corpus: TextCorpus, seed: int):
    """(files, epochs, global batches) of the seed's stream: the same for every ordering."""
    need = config.tokens_per_batch * (config.steps + 1)
    files, epochs, lengths = plans_mod.document_stream(corpus.train_files, corpus.lengths, need, seed)
    return files, epochs, plans_mod.stream_batches(lengths, config.window, config.tokens_per_batch, config.steps)


def heldout_plan(config: ConvergeConfig, corpus: TextCorpus, cost: CostModel):
    """The held-out documents (ids = file indices) packed into fixed-length micro-batches."""
    files = corpus.heldout_files
    pieces, ids, offsets = split_documents(corpus.lengths[files], config.window, ids=files)
    n_bins = max(1, -(-int(pieces.sum()) // config.window))
    while True:  # enough bins that nothing is deferred (the packing does not change the loss)
        plan = solve_pack(pieces, n_bins, config.window, cost, "fixed", ids=ids, offsets=offsets)
        if not len(plan.deferred):
            return plan
        n_bins += max(1, n_bins // 8)


def evaluate(model, plan, data) -> float:
    """Mean next-token loss (nats per target token) of `model` on the plan's micro-batches."""
    import torch
    import torch.nn.functional as F

    from ..batch import IGNORE, pack_micro_batch, packed_positions
    from ..kernels import doc_attention
    from ..kernels.segments import segments_from_lengths

    total, count = 0.0, 0
    with torch.no_grad():
        for j, mb in enumerate(plan.micro_batches):
            if not len(mb):
                continue
            lengths = plan.lengths[mb]
            tokens, labels = pack_micro_batch(plan, j, data)
            seg = segments_from_lengths(lengths)
            positions = torch.from_numpy(packed_positions(lengths, plan.offsets[mb]))
            logits = model(tokens, positions, lambda q, k, v: doc_attention(q, k, v, seg, backend="torch"))
            total += float(F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum"))
            count += int((labels != IGNORE).sum())
    return total / count


def run_job(config: ConvergeConfig, ordering: str, seed: int) -> dict:
    """Train one (ordering, seed) and return its row (curves, packing facts, timing)."""
    import torch

    from ..batch import target_tokens
    from ..executor import TinyLM, train_step
    from ..shard import solve_shard

    started, cpu_started = time.perf_counter(), time.process_time()
    corpus = load_corpus(config)
    cost = config.cost()
    files, epochs, batches = seed_stream(config, corpus, seed)
    steps, facts = plans_mod.ordering_steps(ordering, batches, config.n_micro, config.window, cost)
    plans_mod.check_every_token_once(steps, batches)
    moved = plans_mod.displacement(steps, plans_mod.arrival_batches(batches))
    imbalances = plans_mod.step_imbalances(steps, cost)
    tokens = plans_mod.step_tokens(steps)

    def train_data(doc_id: int):  # stream position -> the document's tokens in its epoch
        return torch.from_numpy(corpus.tokens(int(files[doc_id]), int(epochs[doc_id])).astype(np.int64))

    def heldout_data(file: int):
        return torch.from_numpy(corpus.tokens(int(file), 0).astype(np.int64))

    heldout = heldout_plan(config, corpus, cost)
    torch.manual_seed(seed)
    model = TinyLM.from_spec(config.model_spec())
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    train_loss, heldout_loss, heldout_steps = [], [evaluate(model, heldout, heldout_data)], [0]
    for s, plan in enumerate(steps):
        for group in opt.param_groups:
            group["lr"] = config.lr_at(s)
        shards = [solve_shard(plan.lengths[mb], 1, "per_doc", cost, offsets=plan.offsets[mb]) if len(mb) else None
                  for mb in plan.micro_batches]
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, plan, shards, data=train_data, backend="torch", step=s)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        opt.step()
        if not math.isfinite(loss):
            raise RuntimeError(f"{ordering} seed {seed}: loss {loss} at step {s}")
        train_loss.append(loss)
        if (s + 1) % config.eval_every == 0 or s >= len(steps) - FINAL_EVALS:
            heldout_loss.append(evaluate(model, heldout, heldout_data))
            heldout_steps.append(s + 1)
    final = [h for h, at in zip(heldout_loss, heldout_steps) if at > len(steps) - FINAL_EVALS]
    return dict(ordering=ordering, seed=seed, steps=len(steps), train_loss=train_loss, heldout_loss=heldout_loss,
                final_heldout=float(np.mean(final)),
                heldout_steps=heldout_steps, displacement_per_token=moved["displacement_per_token"],
                delay_per_token=moved["delay_per_token"], moved_token_share=moved["moved_token_share"],
                imbalance=float(imbalances.mean()), imbalance_p90=float(np.percentile(imbalances, 90)),
                tokens_per_step_mean=float(tokens.mean()), tokens_per_step_cv=float(tokens.std() / tokens.mean()),
                tokens_per_step=tokens.tolist(), targets_per_step=[target_tokens(p) for p in steps],
                wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu_started, **facts)
