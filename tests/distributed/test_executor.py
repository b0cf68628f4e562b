"""Context-parallel attention over real gloo process groups against a single-process reference.

Each spawned rank builds the same random packed micro-batch, computes the document-masked
attention and its gradients on the whole sequence in one process (explicit-mask fp64
reference), then runs context_parallel_attention on its own shard and compares its output
and its dQ, dK, dV rows. A negative control shows that the released WLB-LLM layout bug
(reduce-scattering dK/dV in packed instead of rank-major order) would be caught.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import wlb_opt as wlb  # noqa: E402
from wlb_opt.kernels.reference import attention_reference  # noqa: E402
from wlb_opt.kernels.segments import segments_from_lengths  # noqa: E402

CASES = [[5, 17, 3, 9], [1, 1, 2, 40], [33], [7, 2, 11, 4, 1, 6], [2, 1]]  # [2, 1]: empty ranks at cp=4


@dataclass
class HeadTailShard:
    """An independent, minimal per-document head-tail shard (not wlb's code): document i is cut
    into 2*cp nearly equal contiguous chunks; rank r owns chunks r and 2cp-1-r."""

    rank_indices: list
    segments: list


def head_tail_shard(lengths, cp) -> HeadTailShard:
    idx = [[] for _ in range(cp)]
    segs = [[] for _ in range(cp)]
    start = 0
    for d in lengths:
        bounds = np.linspace(0, d, 2 * cp + 1).astype(int)
        for r in range(cp):
            for c in (r, 2 * cp - 1 - r):
                a, b = bounds[c], bounds[c + 1]
                if b > a:
                    segs[r].append((len(idx[r]), b - a, start, b))
                    idx[r].extend(range(start + a, start + b))
        start += d
    return HeadTailShard([np.array(i, dtype=np.int64) for i in idx],
                         [np.array(s, dtype=np.int32).reshape(-1, 4) for s in segs])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(total: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(total, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(total, 2, 16, generator=g, dtype=torch.float64)
    w = torch.randn(total, 4, 16, generator=g, dtype=torch.float64)
    return q, k, v, w


def _reference(lengths, seed):
    q, k, v, w = _tensors(int(sum(lengths)), seed)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, _ = attention_reference(q, k, v, segments_from_lengths(lengths))
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank: int, world: int, port: int, strategies: list[str]) -> None:
    from wlb_opt.executor import context_parallel_attention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(cp=world),
                                      wlb.HardwareSpec.preset("cpu"))
        for case, lengths in enumerate(CASES):
            ref_out, ref_dq, ref_dk, ref_dv = _reference(lengths, seed=case)
            shards = {"independent-head-tail": head_tail_shard(lengths, world)}
            for strategy in strategies:
                shards[strategy] = wlb.solve_shard(lengths, world, strategy, cost)
            for name, shard in shards.items():
                q, k, v, w = _tensors(int(sum(lengths)), seed=case)
                idx = torch.tensor(shard.rank_indices[rank], dtype=torch.int64)
                grads = {}
                for regather in (False, True):  # keep the gathered K/V, or gather them again
                    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
                    out = context_parallel_attention(ql, kl, vl, shard, backend="torch", regather=regather)
                    (out * w[idx]).sum().backward()
                    msg = f"rank {rank}/{world}, case {lengths}, shard {name}, regather {regather}"
                    torch.testing.assert_close(out, ref_out[idx], msg=lambda m: f"{msg}: out {m}")
                    torch.testing.assert_close(ql.grad, ref_dq[idx], msg=lambda m: f"{msg}: dq {m}")
                    torch.testing.assert_close(kl.grad, ref_dk[idx], msg=lambda m: f"{msg}: dk {m}")
                    torch.testing.assert_close(vl.grad, ref_dv[idx], msg=lambda m: f"{msg}: dv {m}")
                    grads[regather] = (ql.grad, kl.grad, vl.grad)
                assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True])), msg
                # the K/V all-gather started early (asynchronous) gives the same result bitwise
                from wlb_opt.executor import prefetch_kv

                ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
                pending = prefetch_kv(kl, vl, shard)
                out = context_parallel_attention(ql, kl, vl, shard, backend="torch", prefetched=pending)
                (out * w[idx]).sum().backward()
                torch.testing.assert_close(out, ref_out[idx], msg=lambda m: f"{msg}, prefetched: out {m}")
                assert all(torch.equal(a, b) for a, b in zip(grads[False], (ql.grad, kl.grad, vl.grad))), msg
    finally:
        dist.destroy_process_group()


def _strategies() -> list[str]:
    try:
        wlb.solve_shard
    except (AttributeError, ImportError, ModuleNotFoundError):
        return []
    return ["per_seq", "per_doc", "adaptive", "hybrid"]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_matches_single_process_reference(world):
    mp.spawn(_worker, args=(world, free_port(), _strategies()), nprocs=world, join=True)


def test_packed_order_reduce_scatter_would_be_caught():
    """The WLB-LLM artifact bug, reproduced in-process: slicing the packed-order dK by rank
    counts instead of by rank_indices gives gradients that differ from the reference."""
    lengths, cp = [5, 17, 3, 9], 2
    shard = head_tail_shard(lengths, cp)
    _, _, ref_dk, _ = _reference(lengths, seed=0)
    counts = [len(ix) for ix in shard.rank_indices]
    buggy = torch.split(ref_dk, counts)  # packed order, split as if it were rank-major
    right = [ref_dk[torch.from_numpy(ix)] for ix in shard.rank_indices]
    assert not all(torch.allclose(b, r) for b, r in zip(buggy, right))


def test_single_process_without_group_equals_reference():
    from wlb_opt.executor import context_parallel_attention

    lengths = [6, 10]
    shard = head_tail_shard(lengths, 1)
    q, k, v, w = _tensors(16, seed=3)
    out = context_parallel_attention(q, k, v, shard, backend="torch")
    ref, _ = attention_reference(q, k, v, segments_from_lengths(lengths))
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="tokens"):
        context_parallel_attention(q[:5], k[:5], v[:5], shard, backend="torch")


def _triton_worker(rank: int, world: int, port: int) -> None:
    """The Triton path (interpreter) with its dK/dV reduce-scatter started before the dQ kernel."""
    import wlb_opt.kernels.triton_kernels as tk
    from wlb_opt.executor import context_parallel_attention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    events: list[str] = []
    real_rs, real_dq = dist.reduce_scatter_tensor, tk._dq_kernel

    class _LoggedKernel:
        def __getitem__(self, grid):
            events.append("dq kernel")
            return real_dq[grid]

    def logged_rs(*args, **kwargs):
        events.append(f"reduce-scatter async={kwargs.get('async_op', False)}")
        return real_rs(*args, **kwargs)

    try:
        lengths = [13, 1, 30, 4]
        cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(cp=world),
                                      wlb.HardwareSpec.preset("cpu"))
        shard = wlb.solve_shard(lengths, world, "per_doc", cost)
        ref_out, ref_dq, ref_dk, ref_dv = _reference(lengths, seed=7)
        q, k, v, w = _tensors(int(sum(lengths)), seed=7)
        idx = torch.tensor(shard.rank_indices[rank], dtype=torch.int64)
        ql, kl, vl = (x[idx].float().clone().requires_grad_() for x in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, shard, backend="triton")
        dist.reduce_scatter_tensor, tk._dq_kernel = logged_rs, _LoggedKernel()
        try:
            (out * w[idx].float()).sum().backward()
        finally:
            dist.reduce_scatter_tensor, tk._dq_kernel = real_rs, real_dq
        for name, got, want in (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk),
                                ("dv", vl.grad, ref_dv)):
            torch.testing.assert_close(got.double(), want[idx], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"rank {rank} triton {name}: {m}")
        assert events[:2] == ["reduce-scatter async=True", "dq kernel"], events
    finally:
        dist.destroy_process_group()


def test_triton_cp_backward_starts_the_dkdv_reduce_scatter_before_the_dq_kernel():
    mp.spawn(_triton_worker, args=(2, free_port()), nprocs=2, join=True)
