"""Train a torchtitan decoder with WLB's variable-length 4D step (`WLBTrainer`), CPU or GPU.

    torchrun --standalone --nproc_per_node 2 examples/train_titan.py --cp 2 --steps 3 --check-reference
    torchrun --standalone --nproc_per_node 2 examples/train_titan.py --pp 2 --check-reference
    torchrun --standalone --nproc_per_node 2 examples/train_titan.py --dp 2 --fsdp --check-reference
    torchrun --standalone --nproc_per_node 2 examples/train_titan.py --tp 2 --family qwen3 --check-reference

The model is a small torchtitan llama3 or qwen3 config (`small_config`; `--flavor NAME` takes a
registered flavor instead), trained by torchtitan's own Trainer machinery (its optimizer, LR
schedule, gradient clipping, metrics and checkpointer) with `WLBTrainer`'s step. Documents
are random byte sequences of lognormal lengths (seeded, the same on every rank), planned by
`WLBPacker` with the no-tuning defaults. `--dp` without `--fsdp` replicates (torchtitan's
dp_replicate), with it shards (dp_shard). On a machine without GPUs the run uses gloo and
`run_on_cpu()`.

`--check-reference` trains in fp32 with `REFERENCE_ADAM` and no clipping, then rank 0 reruns the same steps
in one process through torchtitan's own path (causal SDPA, each piece its own batch-1
sequence with positions offset + arange, `reference_loss`) from the same initial weights,
and prints as its last line ``reference check: max abs diff <x>`` (relative to the largest
value) over every step's loss and the final parameters, exiting non-zero above 1e-5.
"""
from __future__ import annotations

import argparse
import dataclasses
import copy
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import wlb_opt as wlb
from wlb_opt.cost_args import count, natural
from wlb_opt.integrations import torchtitan as tt


REFERENCE_ADAM = dict(betas=(0.0, 0.0), eps=1.0, weight_decay=0.0)
"""The optimizer of `--check-reference`: Adam without moments and with eps far above any
gradient, i.e. an update lr * g / (|g| + 1), smooth in the gradient (torchtitan's optimizers
are Adam, AdamW and Muon; plain Adam divides by |g| and turns rounding into sign flips)."""


def documents(n: int, seq_len: int, vocab: int, seed: int = 0) -> list:
    """`n` random documents (id, tokens) of lognormal lengths, each at most `seq_len` tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(4.0, 1.0, n).astype(int), 2, seq_len)
    return [(i, rng.integers(0, vocab, int(length))) for i, length in enumerate(lengths)]


def make_stream(args, model_config, world: int):
    dp = args.dp
    cost = wlb.CostModel.analytic(wlb.ModelSpec.from_torchtitan(model_config),
                                  wlb.ParallelSpec(dp=dp, cp=args.cp, pp=args.pp, tp=args.tp),
                                  wlb.HardwareSpec.preset("h100" if torch.cuda.is_available() else "cpu"))
    n_micro = 2 * args.pp * args.virtual_stages
    packer = wlb.WLBPacker(n_micro, args.max_tokens, cost)
    docs = documents(args.documents, args.seq_len, model_config.vocab_size)
    return wlb.WLBStream(docs, packer, args.max_tokens * n_micro * dp, window=args.max_tokens,
                         strategy="hybrid" if args.cp > 1 else "adaptive"), n_micro


def trainer_config(args, spec, stream, n_micro: int, dump: str):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, default_adamw
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig

    if args.check_reference:  # the rerun applies the same optimizer (REFERENCE_ADAM) with torch.optim.Adam
        optimizer = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": args.lr, **REFERENCE_ADAM})],
            implementation="for-loop")
    else:
        optimizer = default_adamw(lr=args.lr)
    return tt.WLBTrainer.Config(
        model_spec=spec, dump_folder=dump, dataloader=tt.WLBDataLoader.Config(stream=stream),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(  # constant under --check-reference (min_lr_factor 1)
            warmup_steps=0, total_steps=args.schedule_steps or args.steps,
            min_lr_factor=1.0 if args.check_reference else 0.0),
        training=TrainingConfig(local_batch_size=n_micro, seq_len=args.seq_len, steps=args.steps,
                                max_norm=1e9 if args.check_reference else 1.0, mixed_precision_param="float32",
                                disable_cuda_graphs=not torch.cuda.is_available()),
        parallelism=ParallelismConfig(
            spmd_backend="partial_dtensor", data_parallel_replicate_degree=1 if args.fsdp else args.dp,
            data_parallel_shard_degree=args.dp if args.fsdp else 1, context_parallel_degree=args.cp,
            tensor_parallel_degree=args.tp, enable_sequence_parallel=False, pipeline_parallel_degree=args.pp),
        virtual_stages=args.virtual_stages, metrics=MetricsProcessor.Config(log_freq=1),
        debug=DebugConfig(seed=args.seed),
        checkpoint=CheckpointManager.Config(enable=args.checkpoint_every > 0, folder="checkpoint",
                                            interval=max(1, args.checkpoint_every), last_save_model_only=False))


def full_parameters(trainer) -> dict:
    """name -> full fp64 CPU tensor of every parameter this rank's parts hold, under each of
    its names (a tied weight under both; a collective: every rank calls it)."""
    out = {}
    for part in trainer.model_parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):  # activation checkpointing, compile
                name = name.replace(wrapper, "")
            out[name] = t.detach().to("cpu", torch.float64).clone()
    return out


def gather_on_rank0(local: dict) -> dict | None:
    everything = [None] * dist.get_world_size() if dist.is_initialized() else [local]
    if dist.is_initialized():
        dist.all_gather_object(everything, local)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    merged = {}
    for d in everything:
        merged.update(d)
    return merged


def check_reference(args, model_config, initial: dict, final: dict, losses: list[float]) -> float:
    """Rank 0: the same steps through torchtitan's own path, in one process; the largest
    difference relative to the largest value, over losses and final parameters."""
    ref = tt.reference_model(model_config, seq_len=args.seq_len)
    ref.load_state_dict({k: v.to(torch.float32) for k, v in initial.items()}, strict=True)
    stream, _ = make_stream(args, model_config, 1)
    optimizer = torch.optim.Adam(ref.parameters(), lr=args.lr, foreach=False, **REFERENCE_ADAM)
    worst = 0.0
    for k, step in zip(range(args.steps), stream):
        optimizer.zero_grad()
        loss = tt.reference_loss(ref, step)
        loss.backward()
        worst = max(worst, abs(float(loss) - losses[k]) / abs(float(loss)))
        optimizer.step()
    scale = max(float(t.abs().max()) for t in final.values())
    for name, p in ref.named_parameters():
        worst = max(worst, float((p.detach().double() - final[name]).abs().max()) / scale)
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("dp", "pp", "cp", "tp"):
        p.add_argument(f"--{name}", type=count, default=1)
    p.add_argument("--fsdp", action="store_true", help="shard over dp (torchtitan's dp_shard) instead of replicating")
    p.add_argument("--virtual-stages", type=count, default=1)
    p.add_argument("--steps", type=count, default=3)
    p.add_argument("--schedule-steps", type=count, default=None,
                   help="steps of the LR schedule (default --steps; keep it fixed across a resume)")
    p.add_argument("--family", choices=tt.SUPPORTED, default="llama3")
    p.add_argument("--flavor", default=None, help="a registered torchtitan flavor instead of the small config")
    p.add_argument("--separate-qkv", action="store_true", help="separate Q/K/V projections (default: fused)")
    p.add_argument("--max-tokens", type=count, default=256, help="tokens per micro-batch")
    p.add_argument("--seq-len", type=count, default=1024, help="training.seq_len: the RoPE table, >= any document")
    p.add_argument("--documents", type=count, default=400)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=natural, default=0)
    p.add_argument("--checkpoint-every", type=natural, default=0, help="torchtitan checkpoint interval (0: off)")
    p.add_argument("--dump-folder", default=None)
    p.add_argument("--check-reference", action="store_true")
    args = p.parse_args()
    saved = Path(args.dump_folder or "/nonexistent") / "checkpoint"
    if args.check_reference and saved.is_dir() and any(saved.iterdir()):
        p.error(f"--check-reference replays the run from step 1 with fresh weights, so it cannot check a run that "
                f"resumes from the checkpoints in {saved}; give an empty --dump-folder")

    for name, value in os.environ.items():
        if name == "WORLD_SIZE" and int(value) != args.dp * args.pp * args.cp * args.tp:
            raise SystemExit(f"--dp x --pp x --cp x --tp = {args.dp * args.pp * args.cp * args.tp} but "
                             f"WORLD_SIZE={value}")
    if not torch.cuda.is_available():
        tt.run_on_cpu()
    if args.flavor:
        from importlib import import_module

        spec = import_module(f"torchtitan.models.{args.family}").model_registry(args.flavor)
    else:
        from torchtitan.models.llama3 import model_registry

        spec = model_registry("debugmodel")  # its parallelize function and state-dict adapter
        if args.family == "qwen3":
            from torchtitan.models.qwen3 import model_registry

            spec = model_registry("debugmodel")
        spec = dataclasses.replace(spec, model=tt.small_config(args.family, max_seq_len=args.seq_len,
                                                              fuse_qkv=not args.separate_qkv))
    model_config = copy.deepcopy(spec.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    stream, n_micro = make_stream(args, model_config, world)
    dump = args.dump_folder or tempfile.mkdtemp(prefix="wlb_titan_")
    trainer = trainer_config(args, spec, stream, n_micro, dump).build()
    losses: list[float] = []
    step_fn = trainer.train_step

    def recording(data_iterator):
        step_fn(data_iterator)
        losses.append(trainer.last_loss)
        if dist.get_rank() == 0:
            print(f"step {trainer.step}: loss {trainer.last_loss:.6f}", flush=True)

    trainer.train_step = recording
    initial = gather_on_rank0(full_parameters(trainer)) if args.check_reference else None
    try:
        trainer.train()
        final = gather_on_rank0(full_parameters(trainer)) if args.check_reference else None
    finally:
        trainer.close()
    if args.check_reference and dist.get_rank() == 0:
        diff = check_reference(args, model_config, initial, final, losses)
        print(f"reference check: max abs diff {diff:.3e}", flush=True)
        if diff > 1e-5:
            dist.destroy_process_group()
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
