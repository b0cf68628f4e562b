"""Who did not arrive: when a collective or p2p wait fails, name the rank(s) that caused it.

A timeout or a closed connection tells a rank only that its own wait failed. `train_step`
therefore checks every rank in for each step in the default group's store (`RollCall`: one
append per step), records there the error of a rank that leaves the step by an exception,
and `reporting_waits` turns a failed wait into a RuntimeError naming the step, this rank, the
operation and the ranks that did not arrive (`culprits`): those that raised, never started
the step, or reported nothing within a grace period. The store lives with rank 0 under
tcp:// and env:// initialisation; when it no longer answers, its host is the one gone.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch.distributed as dist

_COMM_FAILURE_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
ROLLCALL_GRACE_S = 30.0
"""The longest a rank whose wait failed waits for the others to report before it names the
ranks that did not (the mesh's timeout when shorter)."""


def _is_comm_failure(exc: BaseException) -> bool:
    backend_error = getattr(dist, "DistBackendError", None)
    text = str(exc).lower()
    return (backend_error is not None and isinstance(exc, backend_error)) or any(w in text for w in _COMM_FAILURE_WORDS)


class PeerWaitError(RuntimeError):
    """A wait of this rank failed because a peer stalled or left; raised by `reporting_waits`."""


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def culprits(world: int, rank: int, started: set, failed: set, raised: dict, timed_out: bool,
             out_of_time: bool) -> str | None:
    """Who did not arrive, in words, from the roll call of one step, or None while it is too
    early to tell. `started`, `failed`: ranks that began the step, and ranks whose wait failed
    in it; `raised`: rank -> the error it raised in it. A rank that raised is named at once;
    a rank that never began the step once every other has reported (or, unless this rank's
    wait timed out, when `out_of_time`); a rank that began it but reported nothing when
    `out_of_time`."""
    raised = {q: text for q, text in raised.items() if q != rank}
    if raised:
        what = "; ".join(f"rank {q}: {raised[q]}" for q in sorted(raised))
        return f"{_ranks_text(raised)} did not arrive: raised an error in this step ({what})"
    unexplained = set(range(world)) - {rank} - set(failed)
    if not unexplained:
        return ("every other rank's wait failed as well: no rank raised or stayed away (the network or the backend "
                "failed, or a rank stalled inside a wait)")
    away, silent = unexplained - set(started), unexplained & set(started)
    if not (out_of_time or (timed_out and not silent)):
        return None
    before = "never started this step: stalled or exited before it"
    during = "started it but reported neither an error nor a failed wait: exited or stalled during it"
    if not silent or not away:
        return f"{_ranks_text(unexplained)} did not arrive ({before if away else during})"
    return (f"{_ranks_text(unexplained)} did not arrive ({_ranks_text(away)} {before}; {_ranks_text(silent)} "
            f"{during})")


class RollCall:
    """Check-ins of one `train_step` call in the default group's store, to name absent ranks.

    Each rank appends its number to the call's "started" key when the step begins (one
    store operation per step), to "raised" with its error when it leaves the step by an
    exception, and to "failed" when one of its waits fails. A rank whose wait failed then
    reads those three keys until it can tell who did not arrive (`culprits`), at most
    `grace_s` seconds. Rank 0 deletes the keys of the call two before. The store lives with
    rank 0 under tcp:// and env:// initialisation: when it does not answer, its host is gone.
    """

    _calls = 0

    def __init__(self, store, rank: int, world: int, call: int, grace_s: float):
        self.store, self.rank, self.world, self.call, self.grace_s = store, rank, world, call, grace_s
        self.store_error: BaseException | None = None

    @classmethod
    def begin(cls, grace_s: float = ROLLCALL_GRACE_S) -> "RollCall | None":
        """Check this rank in for a new step (None when there is no group of two or more ranks,
        or no store). Every rank counts its calls, so the n-th call is the same step on all."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        cls._calls += 1
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            store = _get_default_store()
        except Exception:  # noqa: BLE001 - a backend without a store: no roll call
            return None
        roll = cls(store, dist.get_rank(), dist.get_world_size(), cls._calls, grace_s)
        try:
            store.append(roll._key("started"), f"{roll.rank},")
            if roll.rank == 0 and roll.call > 2:
                for name in ("started", "failed", "raised"):
                    store.delete_key(roll._key(name, roll.call - 2))
        except Exception as exc:  # noqa: BLE001 - reported when a wait fails
            roll.store_error = exc
        return roll

    def _key(self, name: str, call: int | None = None) -> str:
        return f"wlb_opt/rollcall/{self.call if call is None else call}/{name}"

    def _ranks(self, name: str) -> set[int]:
        key = self._key(name)
        if not self.store.check([key]):
            return set()
        return {int(r) for r in self.store.get(key).decode().split(",") if r}

    def raised(self, exc: BaseException) -> None:
        """Record that this rank leaves the step with `exc` (best effort: never raises)."""
        if self.store_error is not None:
            return
        try:
            self.store.set(self._key(f"error{self.rank}"), f"{type(exc).__name__}: {str(exc).strip()[:300]}")
            self.store.append(self._key("raised"), f"{self.rank},")
        except Exception:  # noqa: BLE001 - the store is gone; the survivors say so
            pass

    def did_not_arrive(self, timed_out: bool) -> str:
        """Report this rank's failed wait and return who did not arrive, in words."""
        deadline = time.monotonic() + self.grace_s
        pause = 0.05
        try:
            if self.store_error is not None:
                raise self.store_error
            self.store.append(self._key("failed"), f"{self.rank},")
            while True:
                raised = {q: self.store.get(self._key(f"error{q}")).decode() for q in self._ranks("raised")}
                answer = culprits(self.world, self.rank, self._ranks("started"), self._ranks("failed"), raised,
                                  timed_out, time.monotonic() >= deadline)
                if answer is not None:
                    return answer
                time.sleep(pause)
                pause = min(2 * pause, 0.5)
        except Exception as exc:  # noqa: BLE001 - the store does not answer
            return (f"The store host is gone: the rendezvous store does not answer ({type(exc).__name__}: "
                    f"{str(exc).strip()[:160]}); it lives on rank 0 under tcp:// and env:// initialisation, so "
                    "rank 0 did not arrive (exited; under torchrun the launcher's agent hosts it)")


def step_words(step) -> str:
    """How messages name a step: "step 7", or the given words (e.g. a plan's digest)."""
    if step is None:
        return "step ?"
    return step if isinstance(step, str) else f"step {step}"


@contextmanager
def reporting_waits(step, rank: int, operation, rollcall: RollCall | None = None):
    """Run a wait; if the backend fails it (a timeout, a peer gone), raise a PeerWaitError
    (a RuntimeError) naming `step` (an index or words), `rank`, `operation` (a string, or a
    callable returning one, built only on failure) and, with a `rollcall`, the rank(s) that
    did not arrive. Other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, PeerWaitError) or not _is_comm_failure(exc):
            raise
        what = operation() if callable(operation) else operation
        text = str(exc).strip()
        if rollcall is None:
            absent = "A peer rank stalled or failed: look at the ranks this one waited on"
        else:
            absent = rollcall.did_not_arrive(any(w in text.lower() for w in ("timed out", "timeout")))
            absent = absent[0].upper() + absent[1:]
        raise PeerWaitError(f"{step_words(step)}, rank {rank}: {what} did not complete ({type(exc).__name__}: "
                            f"{text[:300]}). {absent}. make_mesh(timeout=...) sets how long the mesh's groups "
                            "wait") from exc
