"""The interleaved pipeline's point-to-point meetings, searched on random operation times.

The best schedules of blocking groups found for the interleaved pipeline: `p2p_schedule`
gives them, and `wlb-opt bench pipeline-replay` compares them with the channels the executor
runs instead (`wlb_opt.executor.pipeline`), which no schedule of blocking groups matches.
Under rendezvous semantics (a send completes only when its receive is posted; a rank waits
for each `batch_isend_irecv` group whole) every message is a meeting of its two ranks:
both wait for the later of the two to reach the group that holds it. A meeting therefore
costs the earlier rank the gap between the two, and the fewer meetings a pair of ranks holds,
the less the step loses to them; but a message can only meet after the op that makes it and
before the op that needs it. The schedule of a pair of ranks is a list of meetings (one
boundary of each rank, non-decreasing on both, so messages keep their order on every pair of
ranks as NCCL matches them), and every message goes to the first meeting after the op that
makes it (`wlb_opt.schedule.place_messages`).

`search_meetings(pp, n_micro, v)` anneals those lists (insert, delete or move one meeting)
and scores each candidate by the rendezvous replay against the ideal DAG on `draws` sets of
log-normal op times (forward 1, backward 2, times a factor of median 1 and log-sigma `sigma`,
drawn from a fixed seed): the mean of the worst tenth of replay / ideal plus a fifth of the
mean. A candidate whose groups deadlock is never accepted (the replay is the checker), nor one
that leaves more outputs of one direction waiting for their send than two (or than the start
does). Everything is seeded, so the search is a pure function of its arguments; nothing
runs it at training time: `python -m wlb_opt.p2p_search` writes wlb_opt/p2p_meetings.json once, keeping a
shape's meetings only where they beat the nominal placement on draws the search did not see
(`compare_on_fresh_draws`), and `wlb_opt.schedule` reads it, so that every rank issues the same
groups. `_evaluate` is the replay of `wlb_opt.rendezvous._replay` over many draws at once
(compiled with numba when it imports); tests/unit/test_p2p_search.py holds it to that replay.

Where a message must reach its receiver right after it is made (the receiver waits for it in
the ideal pipeline, as most do once pp >= 3), its meeting is fixed and costs the sender
whatever the receiver is late by; the search can only gather the messages that have slack
into those meetings, so it gains most at pp = 2.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from .schedule import _messages, meeting_pairs, place_messages, stage_order

try:
    from numba import njit
except ImportError:  # the same function, interpreted
    def njit(*_args, **_kwargs):
        return lambda f: f

MAX_UNSENT = 2
"""Most outputs of one direction a rank may hold made and not yet sent (the executor keeps each
until its send completes), unless the nominal placement the search starts from holds more."""


@njit(cache=True)
def _evaluate(pp, n_ops, sender, at_sender, receiver, at_receiver, dur, ideal):  # pragma: no cover - numba
    """Per draw replay / ideal of the groups that hold message i in the group before op
    at_sender[i] of rank sender[i] and before op at_receiver[i] of rank receiver[i];
    dur[d, rank, k] is op k's seconds in draw d. An empty array if the groups deadlock.

    A group is posted when the rank's previous op ends and completes when every counterpart
    group is posted, then the op runs (`wlb_opt.rendezvous._replay` with no transfer time)."""
    n_messages = sender.shape[0]
    stride = n_ops + 1
    n_groups = pp * stride
    start = np.zeros(n_groups + 1, np.int64)  # counterparts of every group, compressed rows
    for m in range(n_messages):
        start[sender[m] * stride + at_sender[m] + 1] += 1
        start[receiver[m] * stride + at_receiver[m] + 1] += 1
    for g in range(n_groups):
        start[g + 1] += start[g]
    fill = start[:-1].copy()
    other = np.empty(2 * n_messages, np.int64)
    for m in range(n_messages):
        gs = sender[m] * stride + at_sender[m]
        gr = receiver[m] * stride + at_receiver[m]
        other[fill[gs]] = gr
        fill[gs] += 1
        other[fill[gr]] = gs
        fill[gr] += 1
    # the order in which groups complete (the same for every draw), or a deadlock
    at = np.zeros(pp, np.int64)
    order = np.empty(n_groups, np.int64)
    done = 0
    while done < n_groups:
        moved = False
        for r in range(pp):
            while at[r] <= n_ops:
                g = r * stride + at[r]
                ready = True
                for i in range(start[g], start[g + 1]):
                    if at[other[i] // stride] < other[i] % stride:  # counterpart not posted yet
                        ready = False
                        break
                if not ready:
                    break
                order[done] = g
                done += 1
                at[r] += 1
                moved = True
        if not moved:
            return np.empty(0)
    n_draws = dur.shape[0]
    posted = np.zeros((n_draws, n_groups))
    out = np.empty(n_draws)
    for d in range(n_draws):
        step = 0.0
        for i in range(n_groups):
            g = order[i]
            t = posted[d, g]
            for j in range(start[g], start[g + 1]):
                if posted[d, other[j]] > t:
                    t = posted[d, other[j]]
            k = g % stride
            if k < n_ops:
                posted[d, g + 1] = t + dur[d, g // stride, k]
            elif t > step:
                step = t
        out[d] = step / ideal[d]
    return out


def op_times(pp: int, n_micro: int, v: int, draws: int, sigma: float, seed: int):
    """[draws, pp, ops] seconds of every rank's ops in `stage_order` (forward 1 / (pp v),
    backward 2 / (pp v), each times a log-normal factor) and each draw's ideal step time."""
    from .simulate import pipeline_step_time

    rng = np.random.default_rng([seed, pp, n_micro, v])
    orders = [stage_order(r, pp, n_micro, v) for r in range(pp)]
    dur = np.empty((draws, pp, len(orders[0])))
    ideal = np.empty(draws)
    for d in range(draws):
        f = rng.lognormal(0.0, sigma, (pp, v, n_micro)) / (pp * v)
        b = 2.0 * rng.lognormal(0.0, sigma, (pp, v, n_micro)) / (pp * v)
        for r in range(pp):
            dur[d, r] = [(f if ph == "F" else b)[vs % pp, vs // pp, mb] for ph, mb, vs in orders[r]]
        ideal[d] = pipeline_step_time(f, b, "interleaved", v)
    return dur, ideal


def _unsent(pp: int, n_ops: int, sender, made, forward, at_sender) -> int:
    """The most outputs of one direction a rank holds made and not yet sent while a group is
    posted (an output made by op k and sent in the group before op s waits in the groups
    k + 1 .. s)."""
    waiting = np.zeros((pp, 2, n_ops + 2), np.int64)
    np.add.at(waiting, (sender, forward, made + 1), 1)
    np.add.at(waiting, (sender, forward, at_sender + 1), -1)
    return int(np.cumsum(waiting, axis=2).max())


def _initial_meetings(pairs: dict, at_sender, at_receiver) -> dict:
    """Meetings of a placement (each distinct pair of boundaries that holds a message), keeping
    those that leave both lists non-decreasing."""
    out = {}
    for pair, (index, low_to_high, _, _) in pairs.items():
        low = np.where(low_to_high, at_sender[index], at_receiver[index])
        high = np.where(low_to_high, at_receiver[index], at_sender[index])
        kept_low, kept_high = [], []
        for lo, hi in sorted(set(zip(low.tolist(), high.tolist()))):
            if not kept_high or hi >= kept_high[-1]:
                kept_low.append(lo)
                kept_high.append(hi)
        out[pair] = (np.array(kept_low), np.array(kept_high))
    return out


def _score(ratio: np.ndarray) -> float:
    """The search's objective: the mean of the worst tenth of replay / ideal plus a fifth of
    the mean (inf for a deadlock, an empty `ratio`)."""
    if ratio.size == 0:
        return math.inf
    return float(np.sort(ratio)[-max(1, ratio.size // 10):].mean() + 0.2 * ratio.mean())


def _placement(pp: int, n_micro: int, v: int, placement: str):
    """(sender, its group, receiver, its group) of every message of `_messages` under
    `wlb_opt.schedule._plans(..., placement)`, as arrays."""
    from .schedule import _plans

    where = {}
    for r, rank in enumerate(_plans(pp, n_micro, v, placement)):
        for gi, (group, _) in enumerate(rank):
            for o in group:
                where[(r, o)] = gi
    messages = _messages(pp, n_micro, v)
    return (np.array([m[0] for m in messages]), np.array([where[(m[0], m[4])] for m in messages]),
            np.array([m[2] for m in messages]), np.array([where[(m[2], m[5])] for m in messages]))


def _placed(pp: int, n_micro: int, v: int, meetings: dict):
    """(sender boundary, receiver boundary) arrays of every message of `_messages` under `meetings`."""
    n_messages = len(_messages(pp, n_micro, v))
    at_sender, at_receiver = np.zeros(n_messages, np.int64), np.zeros(n_messages, np.int64)
    for pair, msgs in meeting_pairs(pp, n_micro, v).items():
        at_sender[msgs[0]], at_receiver[msgs[0]] = place_messages(msgs, *meetings[pair])
    return at_sender, at_receiver


def compare_on_fresh_draws(pp: int, n_micro: int, v: int, meetings: dict, *, draws: int = 64, sigma: float = 0.3,
                           seed: int = 9974) -> tuple[float, float]:
    """The score of `meetings` and of the nominal placement on draws the search did not see."""
    dur, ideal = op_times(pp, n_micro, v, draws, sigma, seed)
    sender, at_sender, receiver, at_receiver = _placement(pp, n_micro, v, "nominal")
    nominal = _score(_evaluate(pp, dur.shape[2], sender, at_sender, receiver, at_receiver, dur, ideal))
    at_sender, at_receiver = _placed(pp, n_micro, v, meetings)
    return _score(_evaluate(pp, dur.shape[2], sender, at_sender, receiver, at_receiver, dur, ideal)), nominal


def search_meetings(pp: int, n_micro: int, v: int, *, draws: int = 64, sigma: float = 0.3, seed: int = 9973,
                    iterations: int = 30000, temperature: float = 0.003) -> tuple[dict, float]:
    """Meetings of every pair of ranks for shape (pp, n_micro, v), annealed from the nominal
    placement (`wlb_opt.schedule._derived_plan`), and their score (see the module docstring).
    Returns ({(low, high): (low boundaries, high boundaries)}, score); meetings that no message
    uses are dropped."""
    messages = _messages(pp, n_micro, v)
    n_ops = len(stage_order(0, pp, n_micro, v))
    sender = np.array([m[0] for m in messages])
    made = np.array([m[1] for m in messages])
    receiver = np.array([m[2] for m in messages])
    forward = np.array([m[4].direction == "fwd" for m in messages], dtype=np.int64)
    pairs = meeting_pairs(pp, n_micro, v)
    _, at_sender, _, at_receiver = _placement(pp, n_micro, v, "nominal")
    meetings = _initial_meetings(pairs, at_sender, at_receiver)
    for pair, msgs in pairs.items():
        placed = place_messages(msgs, *meetings[pair])
        if placed is None:
            raise RuntimeError(f"shape {(pp, n_micro, v)}: the nominal placement's meetings of {pair} cross")
        at_sender[msgs[0]], at_receiver[msgs[0]] = placed
    dur, ideal = op_times(pp, n_micro, v, draws, sigma, seed)
    unsent = max(MAX_UNSENT, _unsent(pp, n_ops, sender, made, forward, at_sender))

    def score() -> float:
        if _unsent(pp, n_ops, sender, made, forward, at_sender) > unsent:
            return math.inf
        return _score(_evaluate(pp, n_ops, sender, at_sender, receiver, at_receiver, dur, ideal))

    current = score()
    if not math.isfinite(current):
        raise RuntimeError(f"shape {(pp, n_micro, v)}: the nominal placement is not a valid start")
    best, best_meetings = current, dict(meetings)
    rng = np.random.default_rng([seed, pp, n_micro, v, 1])
    keys = list(pairs)
    for it in range(iterations):
        pair = keys[rng.integers(len(keys))]
        low, high = meetings[pair]
        low, high = low.copy(), high.copy()
        move, j = rng.integers(5), rng.integers(len(low) + 1)
        if move == 0 and len(low) > 1:  # delete one
            j = min(j, len(low) - 1)
            low, high = np.delete(low, j), np.delete(high, j)
        elif move in (1, 4):  # insert one between its neighbours, or (4) put one anywhere between them
            if move == 4:
                j = min(j, len(low) - 1)
                low, high = np.delete(low, j), np.delete(high, j)
            lo_min, hi_min = (low[j - 1], high[j - 1]) if j > 0 else (0, 0)
            lo_max, hi_max = (low[j], high[j]) if j < len(low) else (n_ops, n_ops)
            low = np.insert(low, j, rng.integers(lo_min, lo_max + 1))
            high = np.insert(high, j, rng.integers(hi_min, hi_max + 1))
        else:  # move one on one rank (2) or on both (3)
            j = min(j, len(low) - 1)
            step = int(rng.choice([-3, -2, -1, 1, 2, 3]))
            if move == 3 or rng.random() < 0.5:
                low[j] += step
            if move == 3 or low[j] == meetings[pair][0][j]:
                high[j] += step
        if (low.min() < 0 or high.min() < 0 or low.max() > n_ops or high.max() > n_ops
                or np.any(np.diff(low) < 0) or np.any(np.diff(high) < 0)
                or len(set(zip(low.tolist(), high.tolist()))) < len(low)):
            continue
        placed = place_messages(pairs[pair], low, high)
        if placed is None:
            continue
        index = pairs[pair][0]
        kept = at_sender[index].copy(), at_receiver[index].copy()
        at_sender[index], at_receiver[index] = placed
        new = score()
        heat = temperature * (1.0 - it / iterations)
        if new <= current or (heat > 0 and math.isfinite(new) and rng.random() < math.exp((current - new) / heat)):
            current, meetings[pair] = new, (low, high)
            if current < best:
                best, best_meetings = current, dict(meetings)
        else:
            at_sender[index], at_receiver[index] = kept
    used = {}
    for pair, (low, high) in best_meetings.items():
        s, r = place_messages(pairs[pair], low, high)
        lh = pairs[pair][1]
        taken = set(zip(np.where(lh, s, r).tolist(), np.where(lh, r, s).tolist()))
        keep = [j for j in range(len(low)) if (int(low[j]), int(high[j])) in taken]
        used[pair] = ([int(low[j]) for j in keep], [int(high[j]) for j in keep])
    return used, best


def _dumps(table: dict) -> str:
    """The table as JSON, one shape a line."""
    shapes = sorted(table["meetings"].items(), key=lambda kv: tuple(map(int, kv[0].split(","))))
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in shapes)
    searched = f'"searched": {json.dumps(table["searched"], sort_keys=True)},\n' if table.get("searched") else ""
    return f'{{"search": {json.dumps(table["search"])},\n{searched}"meetings": {{\n{rows}\n}}}}\n'


def main(argv: list[str] | None = None) -> int:
    from .cost_args import count  # the command line only: cost_args sits above this module

    p = argparse.ArgumentParser(prog="python -m wlb_opt.p2p_search", description=__doc__.splitlines()[0])
    p.add_argument("--max-pp", type=count, default=8, help="largest pp (default 8)")
    p.add_argument("--max-micro", type=count, default=16, help="largest n_micro, multiples of pp (default 16)")
    p.add_argument("--v", type=count, action="append", default=[], help="virtual stages (repeatable; default 2 and 4)")
    p.add_argument("--draws", type=count, default=64, help="op-time draws per shape (default 64)")
    p.add_argument("--iterations", type=count, default=30000, help="annealing moves per shape (default 30000)")
    p.add_argument("--out", default=str(Path(__file__).with_name("p2p_meetings.json")),
                   help="JSON file; shapes already in it are kept unless searched again")
    args = p.parse_args(argv)
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.exists() else {}
    search = dict(draws=args.draws, sigma=0.3, seed=9973, iterations=args.iterations, temperature=0.003)
    # a shape's meetings are kept only where they beat the nominal placement, and the meetings
    # stored for it, on draws of seed 9974. "search" says how the table's shapes were searched;
    # a shape searched otherwise has its own record in "searched"
    table.setdefault("search", search)
    meetings = table.setdefault("meetings", {})
    for v in args.v or [2, 4]:
        for pp in range(2, args.max_pp + 1):
            for n_micro in range(pp, args.max_micro + 1, pp):
                started = time.process_time()
                key = f"{pp},{n_micro},{v}"
                found, score = search_meetings(pp, n_micro, v, **search)
                fresh, nominal = compare_on_fresh_draws(pp, n_micro, v, found, draws=args.draws)
                stored = meetings.get(key)
                kept = float("inf") if stored is None else compare_on_fresh_draws(
                    pp, n_micro, v, {tuple(map(int, pair.split(","))): (a, b) for pair, (a, b) in stored.items()},
                    draws=args.draws)[0]
                if fresh < min(nominal, kept):
                    meetings[key] = {f"{lo},{hi}": [list(a), list(b)] for (lo, hi), (a, b) in found.items()}
                    searched = table.setdefault("searched", {})
                    if search != table["search"]:
                        searched[key] = search
                    else:
                        searched.pop(key, None)
                elif stored is None or kept >= nominal:  # the nominal placement (`schedule._plans` falls back to it)
                    meetings.pop(key, None)
                    table.get("searched", {}).pop(key, None)
                print(f"pp={pp} n_micro={n_micro} v={v}: score {score:.4f}, on fresh draws {fresh:.4f} "
                      f"(nominal {nominal:.4f}), {sum(len(a) for a, _ in found.values())} meetings, "
                      f"{time.process_time() - started:.0f} s CPU", flush=True)
                out.write_text(_dumps(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
