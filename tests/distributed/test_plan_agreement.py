"""Ranks agree on the plan before a step, and a stalled rank is named, not waited on forever.

Two gloo ranks that hold the same PackPlan but shard a micro-batch differently (`per_doc`
on one, `per_seq` on the other) make the same collectives and used to train silently on a
wrong gradient; `train_step` compares one digest per micro-batch over the PackPlan and the
ShardPlans and raises on every rank, naming the step and the micro-batch. A rank that
never arrives makes the other's wait fail after the group's timeout with the step, the
rank, the operation and the rank that did not arrive in the message (tests/distributed/test_culprit.py
has the other ways a rank fails).
"""
from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import wlb_opt as wlb  # noqa: E402
from conftest import free_port  # noqa: E402
from test_training import doc_tokens, make_model, make_plan, make_shards  # noqa: E402


def _init(rank: int, port: int, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _shard_mismatch_worker(rank: int, port: int, out_dir: str) -> None:
    import wlb_opt.executor as ex

    _init(rank, port, 60)
    try:
        mesh = ex.make_mesh(cp=2)
        plan, cost = make_plan(dp=1, cp=2)
        plan = plan.replace(step=3)
        shards = make_shards(plan, cost, 2, "per_doc" if rank == 0 else "per_seq")
        assert shards[0].digest() != make_shards(plan, cost, 2, "per_seq")[0].digest() or rank == 1
        try:
            ex.train_step(make_model(), plan, shards, data=doc_tokens, mesh=mesh)
            message = "no error"
        except RuntimeError as exc:
            message = str(exc)
        # the same plan and shards on both ranks pass, and return one digest
        same = make_shards(plan, cost, 2, "per_doc")
        digest = ex.check_same_plan(plan, same)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(message + "\n" + digest)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: about one run in ten, a gloo thread still
    # joinable at exit aborted the process ("terminate called without an active exception")
    # after both reports were written and the group destroyed.
    os._exit(0)


def test_ranks_with_different_cp_shard_plans_fail_the_step_on_every_rank(tmp_path):
    mp.spawn(_shard_mismatch_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    reports = [(tmp_path / f"rank{r}.txt").read_text().split("\n") for r in range(2)]
    plan, _ = make_plan(dp=1, cp=2)
    first = next(j for j, mb in enumerate(plan.micro_batches) if len(mb))
    for message, _ in reports:
        assert message.startswith("step 3: ranks hold different plans"), message
        assert f"micro-batch {first}: its CP shard plan differs" in message
        assert "[[0], [1]]" in message  # which rank holds what
    assert reports[0][1] == reports[1][1] and len(reports[0][1]) == 64


def _stall_worker(rank: int, port: int, out_dir: str) -> None:
    import wlb_opt.executor as ex

    _init(rank, port, 3)
    mesh = ex.make_mesh(timeout=3)
    if rank == 1:  # the stalled rank: never reaches the step, until rank 0 has its error (at most 60 s)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out_dir, "rank0.txt")) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(os.path.join(out_dir, "rank1.txt"), "w") as f:
            f.write("released" if os.path.exists(os.path.join(out_dir, "rank0.txt")) else "gave up")
        os._exit(0)
    plan, cost = make_plan(dp=2)
    started = time.monotonic()
    try:
        ex.train_step(make_model(), plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh, step=7)
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
        f.write(f"{time.monotonic() - started:.1f}\n{message}")
    os._exit(0)  # the peer is gone: no collective teardown


def test_a_stalled_rank_is_reported_with_step_rank_and_operation(tmp_path):
    mp.spawn(_stall_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    waited, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert message.startswith("step 7, rank 0: the plan check"), message
    assert "did not complete" in message and "make_mesh(timeout=...)" in message
    assert "Rank 1 did not arrive (never started this step" in message
    # rank 0 failed while rank 1 was still stalled (it waits for rank 0's report), after the 3 s timeout
    assert (tmp_path / "rank1.txt").read_text() == "released"
    assert 2.5 <= float(waited) < 60


def test_first_difference_names_the_first_differing_micro_batch():
    from wlb_opt.executor.plumbing import first_difference, micro_batch_digests

    plan, cost = make_plan(dp=1, cp=2)
    a = micro_batch_digests(plan, make_shards(plan, cost, 2, "per_doc"))
    assert first_difference([a, a]) is None
    swapped = plan.replace(micro_batches=tuple(reversed(plan.micro_batches)))
    b = micro_batch_digests(swapped)
    assert first_difference([a, b]).startswith("micro-batch 0: its pieces differ")
    # a rank that passes no shard for a micro-batch (not run there) is not compared on it
    c = micro_batch_digests(plan, [None] * len(plan.micro_batches))
    assert first_difference([a, c]) is None
    fewer = micro_batch_digests(wlb.solve_pack(np.array([5, 6]), 1, 96, cost, "wlb"))
    assert "number of micro-batches" in first_difference([a, fewer])
