"""wlb_opt.batch: packing, pre-shifted labels, positions (ShardPlan.positions against its
one-process twin), one CP rank's rows; the module stays off `import wlb_opt`; old import
paths still work with a DeprecationWarning."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import wlb_opt as wlb  # noqa: E402
from wlb_opt import batch  # noqa: E402


def doc_tokens(doc_id: int) -> torch.Tensor:
    return torch.arange(100 * doc_id, 100 * doc_id + 40)


def test_positions_labels_and_targets():
    assert batch.packed_positions([3, 2], [0, 32]).tolist() == [0, 1, 2, 32, 33]
    assert batch.packed_positions([], []).tolist() == []
    assert batch.packed_labels(torch.tensor([5, 6, 7, 8, 9]), [3, 2]).tolist() == [6, 7, -100, 9, -100]
    plan = wlb.solve_pack([5, 9, 3], 2, 16, method="wlb", ids=[1, 2, 3])
    assert batch.target_tokens(plan) == 5 + 9 + 3 - 3


def _plan_with_pieces(doc_ids, offsets, lengths):
    """One micro-batch holding the given pieces, in that order."""
    n = len(lengths)
    return wlb.PackPlan(doc_ids=np.array(doc_ids), lengths=np.array(lengths), offsets=np.array(offsets),
                        micro_batches=(np.arange(n),), replica_of=np.zeros(1, np.int64),
                        deferred=np.zeros(0, np.int64), loads=np.zeros(1), tokens=np.array([sum(lengths)]),
                        n_micro=1, max_tokens=64)


def test_pack_micro_batch_with_a_loss_mask_and_offsets():
    plan = _plan_with_pieces([1, 2], [2, 0], [4, 3])

    def masked(doc_id):  # the first three tokens of every document are a prompt
        mask = torch.ones(40, dtype=torch.bool)
        mask[:3] = False
        return doc_tokens(doc_id), mask

    tokens, labels = batch.pack_micro_batch(plan, 0, masked)
    want_tokens, want_labels = [], []
    for doc_id, lo, n in ((1, 2, 4), (2, 0, 3)):
        doc = doc_tokens(doc_id)[lo: lo + n].tolist()
        want_tokens += doc
        # the next token within the piece, where that token is a target (position >= 3)
        want_labels += [doc[t + 1] if lo + t + 1 >= 3 else -100 for t in range(n - 1)] + [-100]
    assert tokens.tolist() == want_tokens and labels.tolist() == want_labels
    assert torch.equal(batch.pack_tokens(plan, 0, doc_tokens), tokens)
    assert batch.packed_positions(plan.lengths, plan.offsets).tolist() == [2, 3, 4, 5, 0, 1, 2]
    with pytest.raises(ValueError, match=r"document 2: data\(2\) returned \(2,\) tokens"):
        batch.pack_micro_batch(plan, 0, lambda i: doc_tokens(i)[:2] if i == 2 else doc_tokens(i))
    with pytest.raises(ValueError, match="token ids must be integers"):
        batch.pack_micro_batch(plan, 0, lambda i: doc_tokens(i).float())
    # a loss mask holds booleans or 0/1 of the document's length: a weight of 0.1 is no target flag
    for mask, words in (([2] * 40, "loss_mask[0] = 2; a loss mask holds booleans or 0/1"),
                        ([0.1] * 40, "loss_mask must be booleans"),
                        ([True] * 39, "loss mask of 39 entries for 40 tokens")):
        with pytest.raises(ValueError, match=re.escape(f"document 1: {words}")):
            batch.pack_micro_batch(plan, 0, lambda i, mask=mask: (doc_tokens(i), mask))


class _Pieces:
    """`data` serving pieces, with a loss mask one entry short for document 1's."""

    def piece(self, doc_id, offset, length):
        return doc_tokens(doc_id)[offset: offset + length], [True] * (length - (doc_id == 1))


def test_a_pieces_loss_mask_is_checked_against_the_piece():
    # one entry short here and one long there would shift the targets of the pieces after it
    plan = _plan_with_pieces([1, 2], [2, 0], [4, 3])
    with pytest.raises(ValueError, match=re.escape("document 1: loss mask of 3 entries for 4 tokens")):
        batch.pack_micro_batch(plan, 0, _Pieces())


@pytest.mark.parametrize("kind", ["tensor", "list", "tuple", "numpy", "pair of lists", "pair with no mask",
                                  "list pair"])
def test_a_document_comes_as_any_sequence_of_ids_or_a_pair_with_its_mask(kind):
    """Every form `data(id)` may return gives the same micro-batch (a 2-token list is the ids,
    never (ids, mask))."""
    plan = wlb.solve_pack([3, 2], 1, 8, method="wlb")
    docs = {0: [10, 11, 12], 1: [20, 21]}
    form = {"tensor": lambda d: torch.tensor(d), "list": list, "tuple": tuple, "numpy": np.array,
            "pair of lists": lambda d: (d, [True] * len(d)), "pair with no mask": lambda d: (torch.tensor(d), None),
            "list pair": lambda d: [np.array(d), np.ones(len(d), dtype=bool)]}
    tokens, labels = batch.pack_micro_batch(plan, 0, lambda i: form[kind](docs[i]))
    order = [int(plan.doc_ids[i]) for i in plan.micro_batches[0]]
    assert tokens.tolist() == [t for i in order for t in docs[i]]
    assert labels.tolist() == [t for i in order for t in docs[i][1:] + [-100]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 4),
       st.sampled_from(["per_seq", "per_doc", "hybrid"]), st.integers(0, 2**16))
def test_shard_positions_are_the_packed_positions_of_the_ranks_rows(lengths, cp, strategy, seed):
    """ShardPlan.positions, the one source of positions, against its one-process twin."""
    offsets = np.random.default_rng(seed).integers(0, 500, len(lengths))
    shard = wlb.solve_shard(lengths, cp, strategy, offsets=offsets)
    whole = batch.packed_positions(lengths, offsets)
    tokens = torch.arange(sum(lengths)) * 3 + 1
    labels = batch.packed_labels(tokens, lengths)
    for r in range(cp):
        idx = np.array(shard.rank_indices[r], dtype=np.int64)
        assert np.array_equal(shard.positions[r], whole[idx])
        rows = batch.rank_inputs(tokens, labels, shard, r)
        assert rows.index.tolist() == idx.tolist()
        assert rows.tokens.tolist() == tokens[idx].tolist() and rows.labels.tolist() == labels[idx].tolist()
        assert rows.positions.dtype == torch.int64 and rows.positions.tolist() == whole[idx].tolist()
        assert rows.targets == int((labels[idx] != batch.IGNORE).sum())
        toks, pos = batch.local_inputs(tokens, shard, r)
        assert torch.equal(toks, rows.tokens) and torch.equal(pos, rows.positions)


def test_empty_rank_inputs():
    rows = batch.RankInputs.empty()
    assert rows.targets == 0 and all(t.numel() == 0 and t.dtype == torch.long
                                     for t in (rows.index, rows.tokens, rows.positions, rows.labels))


@pytest.mark.parametrize("module, name, home", [
    ("wlb_opt.executor", "packed_positions", "wlb_opt.batch"),
    ("wlb_opt.executor", "packed_labels", "wlb_opt.batch"),
    ("wlb_opt.executor", "pack_tokens", "wlb_opt.batch"),
    ("wlb_opt.executor", "target_tokens", "wlb_opt.batch"),
    ("wlb_opt.executor", "local_inputs", "wlb_opt.batch"),
    ("wlb_opt.executor", "cp_context", "wlb_opt.executor.cp_attention"),
    ("wlb_opt.executor", "CPContext", "wlb_opt.executor.cp_attention"),
    ("wlb_opt.executor", "packed_order_index", "wlb_opt.executor.cp_attention"),
    ("wlb_opt.executor", "activation_dtype", "wlb_opt.executor.train"),
    ("wlb_opt.executor", "fsdp_mesh", "wlb_opt.executor.fsdp"),
    ("wlb_opt.executor", "tp_plan", "wlb_opt.executor.tp"),
    ("wlb_opt.executor.train", "pack_micro_batch", "wlb_opt.batch"),
    ("wlb_opt.executor.train", "packed_positions", "wlb_opt.batch"),
    ("wlb_opt.executor.train", "IGNORE", "wlb_opt.batch"),
])
def test_old_import_paths_still_work_with_a_deprecation_warning(module, name, home):
    import importlib

    with pytest.warns(DeprecationWarning, match=home.replace(".", r"\.")):
        got = getattr(importlib.import_module(module), name)
    assert got is getattr(importlib.import_module(home), name)


def test_the_executor_exports_its_public_names_only():
    import wlb_opt.executor as ex

    public = {"context_parallel_attention", "prefetch_kv", "PendingKV", "gather_packed", "train_step", "make_mesh",
              "Mesh", "split_stages", "Stage", "TinyLM", "StageOutputs", "check_same_plan", "broadcast_plan",
              "apply_tensor_parallel", "apply_fsdp", "PeerWaitError", "p2p_schedule", "P2POp"}
    assert set(ex.__all__) == public
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in public:
            getattr(ex, name)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        ex.nonexistent  # noqa: B018


def test_a_cp_context_leaves_the_cache_with_its_plan():
    """The cached index tensors of a finished step's ShardPlan are freed with the plan."""
    import gc

    from wlb_opt.executor import cp_attention

    shard = wlb.solve_shard([40, 7, 13], 2, "per_doc")
    cp_attention.cp_context(shard, None, "cpu", rank=0, world=2)
    keys = [k for k in cp_attention._CONTEXTS if k[0] == id(shard)]
    assert len(keys) == 1 and cp_attention.cp_context(shard, None, "cpu", rank=0, world=2) is \
        cp_attention._CONTEXTS[keys[0]][1]
    del shard
    gc.collect()
    assert keys[0] not in cp_attention._CONTEXTS
