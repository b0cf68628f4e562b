"""Train a Hugging Face causal LM on a real corpus through WLBStream and train_step (CPU or GPU).

    torchrun --standalone --nproc_per_node 2 examples/train_hf.py --cp 2 --steps 5
    torchrun --standalone --nproc_per_node 4 examples/train_hf.py --cp 2 --pp 2 --check-reference
    torchrun --standalone --nproc_per_node 4 examples/train_hf.py --dp 2 --cp 2 --fsdp --check-reference
    torchrun --standalone --nproc_per_node 2 examples/train_hf.py --tp 2 --config my_config.json

The model is built from a config (`--config CONFIG.json`, a transformers config.json, or
`--preset tiny-llama`), never downloaded, with ``attn_implementation="wlb"``. The corpus is
every text file under `--corpus DIR` (default: this Python's standard library sources),
bytes as tokens (vocabulary 256), in the order of their sorted paths. Every rank reads the
same stream and plans it with `WLBPacker` (the no-tuning defaults) inside a DataLoader
worker, so planning runs off the training loop; `train_step` checks that all ranks
hold the same plan. Each step prints its loss, tokens, PP imbalance, delay and tokens/s.

`--check-reference` trains in fp64 with SGD, then rank 0 reruns the same documents and steps
in one process through transformers' own path (``attn_implementation="sdpa"``, one piece at a
time with ``position_ids = offset + arange(length)``), and prints as its last line
``reference check: max abs diff <x>`` over the losses and the parameters, exiting non-zero
above 1e-4.

`--json DIR` also writes one JSON object per step to DIR/rank<r>.jsonl (the baseline:
DIR/hf_packed.jsonl): step, tokens (the global step's), loss, wall_s and cpu_s, the step's
wall seconds and this process's CPU seconds (``time.process_time``, all its threads; the
DataLoader worker that plans is another process and is not counted). `wlb-opt bench
hf-throughput` reads these.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import wlb_opt as wlb
from wlb_opt.cost_args import count
import wlb_opt.executor as ex
from wlb_opt.integrations import hf

TINY_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5)


class Corpus:
    """The text files under `root` as (doc_id, byte tokens), sorted by path; re-iterable (a
    resumed stream re-reads it) and picklable (a DataLoader worker reads it). Empty files are
    left out when the list is built, so every listed document has tokens."""

    def __init__(self, root: str | Path, suffixes=(".py", ".txt", ".md", ".rst"), limit: int | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise SystemExit(f"--corpus {str(root)!r} is not a directory")
        files = sorted(p for p in self.root.rglob("*") if p.suffix in suffixes and p.is_file()
                       and "site-packages" not in p.parts and p.stat().st_size > 0)
        self.files = files[:limit] if limit else files
        if not self.files:
            raise SystemExit(f"--corpus {str(root)!r} holds no {'/'.join(suffixes)} files")

    def __len__(self) -> int:
        return len(self.files)

    def tokens(self, doc_id: int) -> np.ndarray:
        return np.frombuffer(self.files[doc_id].read_bytes(), dtype=np.uint8).astype(np.int64)

    def __iter__(self):
        for i in range(len(self.files)):
            yield i, self.tokens(i)


def build_config(args):
    import transformers

    raw = json.loads(Path(args.config).read_text()) if args.config else dict(TINY_LLAMA)
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise SystemExit("the config has no model_type (a transformers config.json names it)")
    cfg = transformers.AutoConfig.for_model(model_type, **raw)
    if cfg.vocab_size < 256:
        raise SystemExit(f"the corpus uses bytes as tokens: vocab_size must be >= 256, the config has {cfg.vocab_size}")
    cfg.attention_dropout = 0.0
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="a transformers config.json (the model is built from it, not downloaded)")
    src.add_argument("--preset", default="tiny-llama", choices=["tiny-llama"], help="a built-in config (default)")
    p.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"],
                   help="directory of text files, bytes as tokens (default: the Python standard library)")
    p.add_argument("--dp", type=count, default=1)
    p.add_argument("--pp", type=count, default=1)
    p.add_argument("--cp", type=count, default=1)
    p.add_argument("--tp", type=count, default=1)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over dp x cp (not with --tp)")
    p.add_argument("--steps", type=count, default=5)
    p.add_argument("--window", type=count, default=1024, help="context length: longer files are cut into pieces")
    p.add_argument("--n-micro", type=count, default=2, help="micro-batches per replica and step (default 2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check-reference", action="store_true",
                   help="fp64 + SGD, then compare with transformers' own single-process path (rank 0)")
    p.add_argument("--hf-packed", action="store_true",
                   help="baseline, one process without torchrun: the same steps through transformers' own packed "
                        "path (sdpa, position_ids mark the documents), for tokens/s at equal tokens")
    p.add_argument("--json", type=Path, metavar="DIR",
                   help="also write each step's tokens, wall and CPU seconds to DIR/rank<r>.jsonl")
    args = p.parse_args()
    if args.hf_packed:
        ignored = [flag for flag, on in (("--pp", args.pp > 1), ("--cp", args.cp > 1), ("--tp", args.tp > 1),
                                         ("--fsdp", args.fsdp), ("--check-reference", args.check_reference)) if on]
        if ignored:
            p.error(f"--hf-packed runs transformers' own path in one process (only --dp shapes its steps): "
                    f"drop {' '.join(ignored)}")
        return hf_packed_baseline(args)
    if args.fsdp and args.tp > 1:
        p.error("--fsdp with --tp > 1 is not supported yet (2-D FSDP2 + TP)")

    if torch.cuda.is_available():  # the device first: NCCL point-to-point needs it set
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    mesh = ex.make_mesh(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float64 if args.check_reference else torch.float32

    hf.register()
    import transformers

    cfg = build_config(args)
    layout = wlb.ParallelSpec(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.from_hf_config(cfg), layout, wlb.HardwareSpec.preset("cpu"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="wlb",
                                                          dtype=dtype).to(device)
    initial = {n: t.detach().clone().cpu() for n, t in model.state_dict().items()} if args.check_reference else None
    chunks = hf.split_hf_stages(model, args.pp)[mesh.pp_rank::args.pp]
    for chunk in chunks:
        if args.tp > 1:
            ex.apply_tensor_parallel(chunk, mesh.device_mesh["tp"])
        if args.fsdp:
            ex.apply_fsdp(chunk, mesh)
    params = [q for chunk in chunks for q in chunk.parameters()]
    opt = torch.optim.SGD(params, lr=args.lr) if args.check_reference else torch.optim.AdamW(params, lr=args.lr)

    corpus = Corpus(args.corpus)
    max_tokens = int(1.25 * args.window)
    packer = wlb.WLBPacker(args.n_micro, max_tokens, cost)  # the no-tuning defaults (wlb_opt.packer.defaults)
    stream = wlb.WLBStream(corpus, packer, args.dp * args.n_micro * args.window, window=args.window)
    loader = torch.utils.data.DataLoader(stream.as_dataset(), batch_size=None, num_workers=1)
    steps, losses = [], []
    for k, step in enumerate(loader):  # (a step that would place nothing is not yielded: indices may skip)
        if k >= args.steps:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = ex.train_step(chunks, step.plan, step.shards, data=step, mesh=mesh, step=step.index,
                             backend="torch" if args.check_reference else "auto")
        opt.step()
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        plan = step.plan
        placed = np.concatenate([np.asarray(mb, dtype=np.int64) for mb in plan.micro_batches])
        tokens = int(plan.lengths[placed].sum())
        delay = float((plan.delays()[placed] * plan.lengths[placed]).sum() / max(1, tokens))  # steps per token
        steps.append(step)
        losses.append(loss)
        if dist.get_rank() == 0:
            print(f"step {step.index}: loss {loss:.4f}, tokens {tokens}, PP imbalance {plan.imbalance:.3f}, "
                  f"delay {delay:.2f} steps/token, {tokens / seconds:,.0f} tokens/s, planning "
                  f"{step.planning_s * 1e3:.1f} ms (in the loader)", flush=True)
        if args.json:
            _log_step(args.json / f"rank{dist.get_rank()}.jsonl", step.index, tokens, loss, seconds, cpu_seconds)
    failed = False
    if args.check_reference:
        names = {id(q): n for n, q in model.named_parameters()}
        mine = {names[id(q)]: (q.detach().full_tensor() if hasattr(q, "full_tensor") else q.detach()).cpu()
                for q in params}
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, mine)
        if dist.get_rank() == 0:
            trained = {k: v for share in shares for k, v in share.items()}
            diff = reference_check(cfg, initial, steps, losses, trained, args.lr)
            print(f"reference check: max abs diff {diff:.3e}")
            failed = diff > 1e-4
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


def hf_packed_baseline(args) -> None:
    """The same stream (tokens per step = dp x n_micro x window) trained in one process through
    transformers' own packed path: each micro-batch is one row (`hf.hf_batch`), sdpa builds the
    block-diagonal mask from position_ids, and the loss is weighted to the global batch."""
    import transformers

    cfg = build_config(args)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.from_hf_config(cfg), wlb.ParallelSpec(dp=args.dp),
                                  wlb.HardwareSpec.preset("cpu"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                                                          dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    packer = wlb.WLBPacker(args.n_micro, int(1.25 * args.window), cost)
    stream = wlb.WLBStream(Corpus(args.corpus), packer, args.dp * args.n_micro * args.window, window=args.window)
    for k, step in enumerate(stream):
        if k >= args.steps:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss_sum, tokens = 0.0, 0
        for j, mb in enumerate(step.plan.micro_batches):
            if not len(mb):
                continue
            batch = hf.hf_batch(step, j)
            out = model(**batch)  # mean over this row's targets: re-weight to the global batch
            n_targets = int((batch["labels"][0, 1:] != -100).sum())
            loss = out.loss * (n_targets / step.target_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
            tokens += batch["input_ids"].shape[1]
        opt.step()
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        print(f"step {step.index}: loss {loss_sum:.4f}, tokens {tokens}, {tokens / seconds:,.0f} tokens/s "
              "(transformers' packed path, one process)", flush=True)
        if args.json:
            _log_step(args.json / "hf_packed.jsonl", step.index, tokens, loss_sum, seconds, cpu_seconds)


_LOGGED: set[Path] = set()
"""The `--json` files this process has written to."""


def _log_step(path: Path, index: int, tokens: int, loss: float, wall_s: float, cpu_s: float) -> None:
    """Appends one step's line to `path` (the `--json` output; a file from an earlier run is
    started afresh at this run's first line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "a" if path in _LOGGED else "w"
    _LOGGED.add(path)
    with path.open(mode) as f:
        f.write(json.dumps(dict(step=index, tokens=tokens, loss=float(loss), wall_s=wall_s, cpu_s=cpu_s)) + "\n")


def reference_check(cfg, initial: dict, steps, losses, trained: dict, lr: float) -> float:
    """The same steps in one process through transformers' own forward (sdpa), one piece at a
    time, fp64 and SGD; the largest difference over the per-step losses and the parameters."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                                                        dtype=torch.float64)
    ref.load_state_dict(initial)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    worst = 0.0
    for step, dist_loss in zip(steps, losses):
        opt.zero_grad(set_to_none=True)
        plan, loss_sum = step.plan, 0.0
        for mb in plan.micro_batches:
            for i in mb:
                n, off = int(plan.lengths[i]), int(plan.offsets[i])
                if n < 2:
                    continue
                tokens = torch.as_tensor(step.piece(int(plan.doc_ids[i]), off, n)[0])
                logits = ref(tokens[None], position_ids=(off + torch.arange(n))[None]).logits[0]
                loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum") / step.target_tokens
                loss.backward()
                loss_sum += float(loss.detach())
        opt.step()
        worst = max(worst, abs(loss_sum - dist_loss))
    for name, q in ref.named_parameters():
        worst = max(worst, float((q.detach() - trained[name].to(torch.float64)).abs().max()))
    return worst


if __name__ == "__main__":
    main()
