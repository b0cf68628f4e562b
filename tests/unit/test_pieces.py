"""`FreshPieces` and `PieceChain` read as the lists of HeldPieces they stand for."""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import wlb_opt.packer.pieces as pieces_module
from wlb_opt.packer.pieces import FreshPieces, PieceChain, arrived_sums, common_prefix, lengths_of, piece_table, take
from wlb_opt.packer.state import HeldPiece


def _table(rng, n, first_id):
    return np.stack([np.arange(first_id, first_id + n), rng.integers(0, 3, n), rng.integers(1, 9000, n),
                     rng.integers(0, 5, n)]).astype(np.int64)


def _as_list(table):  # the reference: each column a HeldPiece, made one by one
    return [HeldPiece(*(int(x) for x in table[:, i])) for i in range(table.shape[1])]


@st.composite
def chains(draw):
    """(a chain of list and table parts, the list it stands for)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    parts, ref, next_id = [], [], 0
    for kind, n in draw(st.lists(st.tuples(st.sampled_from(["list", "fresh"]), st.integers(0, 12)), max_size=4)):
        view = kind == "fresh" and draw(st.booleans())  # a slice of a larger table
        table = _table(rng, n + 4 * view, next_id)
        next_id += table.shape[1]
        part = _as_list(table) if kind == "list" else FreshPieces(table)
        if view:
            part, table = part[2:2 + n], table[:, 2:2 + n]
        if draw(st.booleans()):  # a chain inside the chain
            part = PieceChain([part])
        ref += _as_list(table)
        parts.append(part)
    return PieceChain(parts), ref


@settings(deadline=None, max_examples=80)
@given(chains(), st.data())
def test_a_chain_reads_as_its_list(pair, data):
    chain, ref = pair
    assert len(chain) == len(ref) and list(chain) == ref and chain == ref and ref == chain
    assert (lengths_of(chain) == np.array([p.length for p in ref], dtype=np.int64)).all()
    for i in range(-len(ref), len(ref)):
        assert chain[i] == ref[i]
    a = data.draw(st.integers(-len(ref) - 2, len(ref) + 2))
    b = data.draw(st.integers(-len(ref) - 2, len(ref) + 2))
    assert list(chain[a:b]) == ref[a:b] and list(chain[a:]) == ref[a:] and list(chain[:b]) == ref[:b]
    assert list(chain[::2]) == ref[::2]
    positions = data.draw(st.lists(st.integers(0, max(len(ref) - 1, 0)), max_size=20)) if ref else []
    assert take(chain, positions) == [ref[i] for i in positions]
    extra = [HeldPiece(-1, 0, 5, 0)]
    assert list(chain + extra) == ref + extra and list(extra + chain) == extra + ref
    assert list(chain[:a] + chain[a:]) == ref
    with pytest.raises(IndexError):
        chain[len(ref)]


@settings(deadline=None, max_examples=60)
@given(chains(), st.data())
def test_a_chains_pieces_taken_as_a_table_and_its_sums_read_as_its_list(pair, data):
    # `take` from LAZY_MIN_PIECES positions (here 2) of a chain that holds a table: a
    # FreshPieces of their own table (a step's carry), read as the pieces taken;
    # `arrived_sums` and `piece_table` of a chain, against the list's
    chain, ref = pair
    positions = data.draw(st.lists(st.integers(0, max(len(ref) - 1, 0)), max_size=20)) if ref else []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pieces_module, "LAZY_MIN_PIECES", 2)
        taken = take(chain, positions)
    assert taken == [ref[i] for i in positions]
    if len(positions) >= 2 and any(isinstance(part, FreshPieces) for part in chain.parts):
        assert isinstance(taken, FreshPieces)
    for step in (-1, 0, 2, 4, 9):
        want = [p for p in ref if p.arrival <= step]
        assert arrived_sums(chain, step) == (sum(p.length for p in want), sum(p.arrival * p.length for p in want))
        assert arrived_sums(ref, step) == arrived_sums(chain, step)
    assert np.array_equal(piece_table(chain), piece_table(ref).reshape(4, -1))


def test_the_common_prefix_of_chains_skips_the_parts_they_share_unread():
    held = FreshPieces(_table(np.random.default_rng(0), 6, 0))
    released = _as_list(_table(np.random.default_rng(1), 3, 100))
    a, b = PieceChain([held, released]), PieceChain([held, released[:2] + [HeldPiece(-1, 0, 5, 0)]])
    assert common_prefix(a, b) == 8 and common_prefix(a, a) == 9 and common_prefix(released, released[:2]) == 2
    assert held._made.pieces is None and not held._made.some  # the shared table was not read
    assert common_prefix(PieceChain([FreshPieces(held.table), released]), a) == 0  # another table: not read
    assert a[:8] == b[:8] and a != b and held._made.pieces is None


def test_fresh_pieces_make_each_piece_once_and_only_those_read():
    table = _table(np.random.default_rng(0), 50, 0)
    fresh = FreshPieces(table)
    third = fresh[3]
    assert fresh._made.pieces is None and set(fresh._made.some) == {3}  # nothing else made
    assert fresh[3] is third and fresh[1:6][2] is third  # a view reads the same pieces
    some = take(fresh, [40, 3, 41])
    assert some[1] is third and some == [HeldPiece(*table[:, i].tolist()) for i in (40, 3, 41)]
    whole = list(fresh)  # iterating makes them all, keeping those made
    assert whole[3] is third and whole[40] is some[0] and whole == _as_list(table)
    assert piece_table(fresh) is table and fresh[:] is fresh and fresh[10:10] == []


def test_a_list_joined_to_fresh_pieces_is_a_chain_that_copies_neither():
    held = [HeldPiece(7, 0, 100, 0)]
    fresh = FreshPieces(_table(np.random.default_rng(1), 5, 100))
    joined = held + fresh
    assert type(joined) is PieceChain and joined.parts == (held, fresh)
    assert joined.before(fresh) == held and (held + joined).before(fresh) == held + held
    assert joined.before(held) is None and joined.fresh_ranges() == [(1, 6)]
    assert fresh._made.pieces is None and not fresh._made.some  # no piece made
    assert joined.index(fresh[2]) == 3 and fresh[2] in joined and joined.count(held[0]) == 1


@pytest.mark.parametrize("release,method,lookahead,max_delay", [
    ("marginal", "wlb_phases", 0, 8), ("marginal", "wlb_phases", 2, 8), ("marginal", "wlb", 0, None),
    ("marginal", "wlb_fill", 2, 8), ("group", "wlb", 2, 8), ("balance", "wlb_phases", 0, 8),
    ("paper", "wlb", 0, None), ("paper", "wlb_ls", 2, 8)])
def test_the_plans_are_the_same_whether_fresh_pieces_are_a_table_or_a_list(release, method, lookahead, max_delay,
                                                                            monkeypatch):
    import wlb_opt as wlb
    import wlb_opt.packer.pieces as pieces_module
    from wlb_opt.packer import PackerConfig, WLBPacker
    from wlb_opt.workloads import global_batches

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                                  wlb.HardwareSpec.preset("h100"))
    batches = global_batches("heavy", 32768, 4 * 32768, 30, seed=5)

    def plans(lazy_from):
        monkeypatch.setattr(pieces_module, "LAZY_MIN_PIECES", lazy_from)
        packer = WLBPacker(4, 40960, cost, config=PackerConfig(release=release, method=method, lookahead=lookahead,
                                                               max_delay=max_delay))
        out = [packer.pack(*b) for b in batches] + packer.drain()
        return [(p.digest(), p.step, p.arrival_step.tolist()) for p in out if p is not None]

    assert plans(0) == plans(10**9)


def test_a_packer_resumed_from_its_state_with_a_carry_held_as_a_table_makes_the_same_plans(monkeypatch):
    # from LAZY_MIN_PIECES pieces (here 2) a step's carry is a table (`take`), and so is the
    # carry of a packer loaded from a state (`as_carry`): a stream resumed at every step plans
    # as the stream run through, and as the one that holds everything as lists
    import wlb_opt as wlb
    from wlb_opt.packer import PackerConfig, WLBPacker
    from wlb_opt.workloads import global_batches

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                                  wlb.HardwareSpec.preset("h100"))
    batches = global_batches("heavy", 32768, 4 * 32768, 30, seed=6)

    def plans(lazy_from, resume):
        monkeypatch.setattr(pieces_module, "LAZY_MIN_PIECES", lazy_from)
        packer, out, tables = WLBPacker(4, 40960, cost, config=PackerConfig(lookahead=2)), [], 0
        for b in batches:
            if resume:
                state = packer.state_dict()
                packer = WLBPacker(4, 40960, cost, config=PackerConfig(lookahead=2))
                packer.load_state_dict(state)
            tables += isinstance(packer._carry, FreshPieces)
            out.append(packer.pack(*b))
        out += packer.drain()
        return [(p.digest(), p.step, p.arrival_step.tolist()) for p in out if p is not None], tables

    (through, tables), (resumed, loaded) = plans(2, False), plans(2, True)
    assert tables > 5 and loaded > 5
    assert through == resumed == plans(10**9, False)[0]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**16), n_held=st.integers(0, 30), n_batch=st.integers(1, 12), n_ids=st.integers(1, 5),
       as_table=st.booleans())
def test_first_clash_is_the_first_batch_piece_that_shares_a_token_with_a_held_one(seed, n_held, n_batch, n_ids,
                                                                                  as_table):
    """`KeySets.first_clash` against a scan of every pair: a clash is found exactly when some
    batch piece shares a token with a held piece of its id, and the one given is such a pair."""
    from wlb_opt.packer.state import HeldPiece, KeySets

    rng = np.random.default_rng(seed)

    def pieces(n):  # n pieces of a few documents, none overlapping another of its document
        out, ends = [], {}
        for _ in range(n):
            i = int(rng.integers(0, n_ids))
            start = ends.get(i, 0) + int(rng.integers(0, 3))
            length = int(rng.integers(1, 6))
            ends[i] = start + length
            out.append((i, start, length))
        return out

    held = pieces(n_held)
    batch = [(i, off + int(rng.integers(-4, 5)) if off > 4 else off, ln) for i, off, ln in pieces(n_batch)]
    batch = [(i, max(0, off), ln) for i, off, ln in batch]
    half = len(held) // 2
    groups = [[HeldPiece(i, o, ln, 0) for i, o, ln in held[:half]], [HeldPiece(i, o, ln, 0) for i, o, ln in held[half:]]]
    if as_table:  # a buffered batch's piece table (ids, offsets, lengths, arrival)
        groups[1] = np.array([[p.id, p.offset, p.length, 0] for p in groups[1]], dtype=np.int64).reshape(-1, 4).T
    keys = KeySets(*groups)
    ids = [i for i, _, _ in batch]
    offsets = np.array([o for _, o, _ in batch], dtype=np.int64)
    lengths = np.array([ln for _, _, ln in batch], dtype=np.int64)
    # the batch's own pieces may overlap each other here: first_clash is told only of held ones
    # after the batch passed its own check, so keep the batches whose pieces do not
    spans = sorted(zip(ids, offsets.tolist(), (offsets + lengths).tolist()))
    assume(not any(a[0] == b[0] and a[2] > b[1] for a, b in zip(spans, spans[1:])))
    clashing = [k for k, (i, o, ln) in enumerate(batch)
                if any(hi == i and o < ho + hl and ho < o + ln for hi, ho, hl in held)]
    got = keys.first_clash(ids, offsets, lengths)
    if not clashing:
        assert got is None
    else:
        k, held_offset, held_length = got
        assert k in clashing
        i, o, ln = batch[k]
        assert (i, held_offset, held_length) in held and o < held_offset + held_length and held_offset < o + ln
