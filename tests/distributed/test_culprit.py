"""A failed or stalled rank is named by every rank that survives it.

Two gloo ranks run one data-parallel step; one of them fails in a given way (raises in its
loss, exits with os._exit in it, stalls before the step past `make_mesh(timeout=...)`), and
the other's error must name the step, itself, the operation and the failing rank. With rank
0 failing, the store that holds the check-ins goes with it: the survivor says the store host
is gone. Timeouts are 2 s for the mesh's groups and 5 s for the default group and the store.
A plan without a step (`solve_pack`) is named by its digest.
"""
from __future__ import annotations

import datetime
import os
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from conftest import free_port  # noqa: E402
from test_training import doc_tokens, make_model, make_plan, make_shards  # noqa: E402

MESH_TIMEOUT_S = 2
GROUP_TIMEOUT_S = 5


def _wait_for(path: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _worker(rank: int, port: int, out_dir: str, failing: int, how: str, step) -> None:
    import wlb_opt.executor as ex

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    mesh = ex.make_mesh(timeout=MESH_TIMEOUT_S)
    plan, cost = make_plan(dp=2)
    plan = plan.replace(step=step)
    survivor = 1 - failing
    report = os.path.join(out_dir, f"rank{survivor}.txt")
    if rank == failing and how == "stalls":  # never reaches the step; leaves once the survivor has reported
        _wait_for(report)
        os._exit(0)

    def loss_fn(hidden, labels, head):
        if rank == failing and how == "raises":
            raise ValueError("a loss that fails on one rank")
        if rank == failing and how == "exits":
            os._exit(0)
        return torch.nn.functional.cross_entropy(head(hidden), labels, ignore_index=-100, reduction="sum")

    try:
        ex.train_step(make_model(), plan, make_shards(plan, cost, 1), data=doc_tokens, mesh=mesh, loss_fn=loss_fn)
        message = "no error"
    except (RuntimeError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    if rank == survivor:
        with open(report + ".part", "w") as f:
            f.write(message)
        os.replace(report + ".part", report)
    else:
        _wait_for(report)  # the failing rank stays until the survivor has reported (its store with it)
    os._exit(0)  # the peer is gone: no collective teardown


def _run(tmp_path, failing: int, how: str, step=7) -> str:
    mp.spawn(_worker, args=(free_port(), str(tmp_path), failing, how, step), nprocs=2, join=True)
    return (tmp_path / f"rank{1 - failing}.txt").read_text()


def test_a_rank_that_raises_is_named_with_its_error(tmp_path):
    message = _run(tmp_path, 1, "raises")
    assert message.startswith("PeerWaitError: step 7, rank 0: "), message
    assert "did not complete" in message and "make_mesh(timeout=...)" in message
    assert "Rank 1 did not arrive: raised an error in this step (rank 1: ValueError: a loss that fails" in message


def test_a_rank_that_exits_is_named_and_a_plan_without_a_step_by_its_digest(tmp_path):
    message = _run(tmp_path, 1, "exits", step=None)
    plan, _ = make_plan(dp=2)
    assert message.startswith(f"PeerWaitError: the step of plan {plan.digest()[:12]}, rank 0: "), message
    assert "Rank 1 did not arrive (started it but reported neither an error nor a failed wait" in message


@pytest.mark.slow  # the default run has its twin: tests/distributed/test_plan_agreement.py's stalled rank
def test_a_rank_that_stalls_before_the_step_is_named(tmp_path):
    message = _run(tmp_path, 1, "stalls")
    assert message.startswith("PeerWaitError: step 7, rank 0: the plan check"), message
    assert "Rank 1 did not arrive (never started this step: stalled or exited before it)" in message


def test_when_rank_0_exits_the_survivor_says_the_store_host_is_gone(tmp_path):
    message = _run(tmp_path, 0, "exits")
    assert message.startswith("PeerWaitError: step 7, rank 1: "), message
    assert "The store host is gone" in message and "rank 0 did not arrive" in message


@pytest.mark.slow
def test_when_rank_0_raises_the_survivor_names_it(tmp_path):
    # rank 0 stays until the survivor reported, so its store still answers
    message = _run(tmp_path, 0, "raises")
    assert "Rank 0 did not arrive: raised an error in this step (rank 0: ValueError" in message, message


@pytest.mark.slow
def test_when_rank_0_stalls_the_survivor_names_it(tmp_path):
    message = _run(tmp_path, 0, "stalls")
    assert message.startswith("PeerWaitError: step 7, rank 1: the plan check"), message
    assert "Rank 0 did not arrive (never started this step" in message


def test_culprits_in_words():
    from wlb_opt.executor.rollcall import culprits

    everyone = {0, 1, 2, 3}
    # too early: rank 3 began the step and may still report
    assert culprits(4, 0, everyone, {0, 1, 2}, {}, timed_out=True, out_of_time=False) is None
    assert "Rank 3 did not arrive (started it" in culprits(4, 0, everyone, {0, 1, 2}, {}, True, True).capitalize()
    # a rank that never began is named at once after a timeout, not after a closed connection
    assert culprits(4, 0, {0, 1, 2}, {0, 1, 2}, {}, True, False).startswith("rank 3 did not arrive (never started")
    assert culprits(4, 0, {0, 1, 2}, {0, 1, 2}, {}, False, False) is None
    # a rank that raised is named at once, with its error
    assert culprits(4, 0, everyone, {0}, {2: "ValueError: x"}, False, False) == \
        "rank 2 did not arrive: raised an error in this step (rank 2: ValueError: x)"
    assert culprits(4, 0, everyone, everyone, {}, True, False).startswith("every other rank's wait failed as well")
    both = culprits(4, 0, {0, 1, 3}, {0}, {}, True, True)
    assert both.startswith("ranks 1, 2, 3 did not arrive (rank 2 never started this step") and "ranks 1, 3 started" in both
