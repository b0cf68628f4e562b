"""The stream's state, its tokens and the packer's id record answer bad input with a clear error.

The same table form as `test_bad_input.py` (id, call, exception type, fragment the message
must hold), checked by its `_check`: the error is the library's own and names the field or
the value. Every state case starts from a real state of a stream mid-run (a document in
flight, pieces held by the packer and its lookahead buffer) and changes one field; the
stream must then be left as it was (a fresh stream stays fresh and loads the good state).
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import wlb_opt as wlb
from test_bad_input import _check


COST = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), None, wlb.HardwareSpec.preset("cpu")).without_layout()
DOCS = [(i, (np.arange(n) * (i + 3)) % 997) for i, n in enumerate([30, 500, 20, 90, 100, 110, 15, 70] * 6)]


def _stream(docs=DOCS, lookahead=1):
    packer = wlb.WLBPacker(2, 128, COST, config=wlb.PackerConfig(max_delay=3, lookahead=lookahead))
    return wlb.WLBStream(docs, packer, 200, window=128)


def _good_state() -> dict:
    for step in _stream():
        state = step.state
        buffer = state["packer"]["lookahead_buffer"]
        if state["pending_from"] and state["cache"] and buffer and buffer[0]:
            return json.loads(json.dumps(state))
    raise AssertionError("no step with a document in flight and cached pieces")


GOOD = _good_state()


def _changed(path: str, value):
    state = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = state
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return state


_DELETE = object()


def _load(state):
    stream = _stream()
    try:
        stream.load_state_dict(state)
    except ValueError:
        stream.load_state_dict(GOOD)  # a refused state leaves the stream fresh
        raise


def _cache_row_length_mismatch():
    state = copy.deepcopy(GOOD)
    state["cache"][0][2] = state["cache"][0][2][:-1]
    return state


def _redigested(state):
    """`state` with its cache digest recomputed, so that the consistency checks are reached."""
    from wlb_opt.stream_state import cache_digest, decode_cache

    state["fingerprint"]["cached_tokens"] = cache_digest(sorted(decode_cache(state["cache"], lengths_only=False).items()))
    return state


def _ended_with_pieces():
    return _changed("ended", True)


STATE_CASES = [
    ("state.version_old", lambda: _load(_changed("version", 1)), ValueError, "got version 1"),
    ("state.not_dict", lambda: _load([1]), ValueError, "a WLBStream state is a dict (state_dict()), got list"),
    *[(f"state.missing.{k}", (lambda k=k: _load(_changed(k, _DELETE))), ValueError, f"no field {k!r}")
      for k in ("config", "packer", "step", "consumed", "pending_from", "draining", "ended", "fingerprint",
                "cache", "integrity")],
    ("state.step_negative", lambda: _load(_changed("step", -1)), ValueError, "state field step must be an integer"),
    ("state.step_float", lambda: _load(_changed("step", 2.0)), ValueError, "state field step must be of type int"),
    ("state.step_bool", lambda: _load(_changed("step", True)), ValueError, "state field step must be of type int"),
    ("state.step_vs_packer", lambda: _load(_changed("step", GOOD["step"] + 1)), ValueError,
     "does not match its packer state's step"),
    ("state.consumed_string", lambda: _load(_changed("consumed", "3")), ValueError, "state field consumed"),
    ("state.consumed_negative", lambda: _load(_changed("consumed", -4)), ValueError, "state field consumed"),
    ("state.pending_from_negative", lambda: _load(_changed("pending_from", -1)), ValueError, "pending_from"),
    ("state.pending_from_without_document", lambda: _load({**_changed("consumed", 0)}), ValueError,
     "pending_from="),
    ("state.draining_int", lambda: _load(_changed("draining", 1)), ValueError, "state field draining"),
    ("state.ended_with_pieces", lambda: _load(_ended_with_pieces()), ValueError, "ended=True"),
    ("state.config_other", lambda: _load(_changed("config.window", 64)), ValueError,
     "with other settings: window=64 there"),
    ("state.cache_not_list", lambda: _load(_changed("cache", {})), ValueError, "state field cache must be"),
    ("state.cache_row_short", lambda: _load(_changed("cache.0", [1, 0])), ValueError, "cache[0] must be"),
    ("state.cache_negative_token", lambda: _load(_changed("cache.0.2", [-1, 2])), ValueError, "is negative"),
    ("state.cache_float_token", lambda: _load(_changed("cache.0.2", [1.5])), ValueError, "integer token ids"),
    ("state.cache_empty_tokens", lambda: _load(_changed("cache.0.2", [])), ValueError, "non-empty list"),
    ("state.cache_mask_ints", lambda: _load(_changed("cache.0.3", [1, 0])), ValueError, "list of booleans"),
    ("state.cache_id_huge", lambda: _load(_changed("cache.0.0", 2**63)), ValueError, "cache[0] id"),
    ("state.cache_wrong_length", lambda: _load(_cache_row_length_mismatch()), ValueError, "cache holds tokens that"),
    ("state.cache_digest_altered", lambda: _load(_changed("fingerprint.cached_tokens", "0" * 32)), ValueError,
     "differ from those the state was saved with"),
    ("state.cache_digest_not_hex", lambda: _load(_changed("fingerprint.cached_tokens", 5)), ValueError,
     "fingerprint.cached_tokens must be a digest"),
    ("state.cache_missing_held_piece", lambda: _load(_redigested(_changed("cache", GOOD["cache"][1:]))), ValueError,
     "no tokens for held piece"),
    ("state.cache_extra_piece", lambda: _load(_redigested(_changed("cache", GOOD["cache"] + [[999, 0, [1], None]]))),
     ValueError, "which its packer state does not hold"),
    ("state.cache_piece_length", lambda: _load(_redigested(_cache_row_length_mismatch())), ValueError,
     "its packer state holds it with"),
    ("state.cache_not_held",
     lambda: _load(_changed("cache", GOOD["cache"][1:])), ValueError, "differ from those"),
    ("state.fingerprint_keys", lambda: _load(_changed("fingerprint", {"documents": "00"})), ValueError,
     "state field fingerprint must be"),
    ("state.fingerprint_digest_short", lambda: _load(_changed("fingerprint.documents", "abc")), ValueError,
     "fingerprint.documents must be a digest"),
    ("state.fingerprint_in_flight_missing", lambda: _load(_changed("fingerprint.in_flight", None)), ValueError,
     "fingerprint.in_flight=None does not match pending_from"),
    ("state.fingerprint_in_flight_length", lambda: _load(_changed("fingerprint.in_flight.length", 1)), ValueError,
     "fingerprint.in_flight.length"),
    ("state.packer_missing_field", lambda: _load(_changed("packer.max_id", _DELETE)), ValueError,
     "no field 'max_id'"),
    ("state.packer_next_auto_id", lambda: _load(_changed("packer.next_auto_id", 0)), ValueError,
     "next_auto_id=0 is not past max_id"),
    ("state.packer_buffer_over_max_tokens", lambda: _load(_changed("packer.lookahead_buffer.0.0.2", 129)),
     ValueError, "129 tokens > max_tokens=128"),
    ("state.integrity_sections", lambda: _load(_changed("integrity", {"position": "0" * 32})), ValueError,
     "integrity must hold the digests"),
    ("state.pending_from_moved", lambda: _load(_changed("pending_from", GOOD["pending_from"] + 128)), ValueError,
     "section 'position'"),
    ("state.draining_flipped", lambda: _load(_changed("draining", True)), ValueError, "section 'position'"),
    ("state.consumed_moved", lambda: _load(_changed("consumed", GOOD["consumed"] + 1)), ValueError,
     "section 'position'"),
    ("state.in_flight_prefix_null", lambda: _load(_changed("fingerprint.in_flight.prefix", None)), ValueError,
     "section 'fingerprint'"),
    ("state.packer_piece_deleted", lambda: _load(_changed("packer.queues.0", [])), ValueError,
     "which its packer state does not hold"),
    ("state.packer_buffer_offset_huge", lambda: _load(_changed("packer.lookahead_buffer.0.0.1", 2**63)), ValueError,
     "0 <= offset < 2**63"),
    ("state.packer_auto_not_bool", lambda: _load(_changed("packer.auto", "yes")), ValueError, "field auto"),
    ("state.packer_version", lambda: _load(_changed("packer.version", None)), ValueError,
     "state field packer (the packer's state): state version None"),
]


def _tokens(tokens, mask=None):
    item = (5, tokens) if mask is None else (5, tokens, mask)
    return list(_stream([(0, [1, 2, 3]), item], lookahead=0))


def _bfloat16(values):
    """A bfloat16 tensor (numpy has no such dtype)."""
    import torch

    return torch.tensor(values, dtype=torch.bfloat16)


TOKEN_CASES = [
    ("tokens.negative", lambda: _tokens([3, -1]), ValueError, "document 5: tokens[1] = -1 is negative"),
    ("tokens.uint64_wrap", lambda: _tokens(np.array([2**63], dtype=np.uint64)), ValueError,
     "tokens[0] = 9223372036854775808 does not fit in int64"),
    ("tokens.python_huge", lambda: _tokens([1, 2**70]), ValueError, "tokens[1] = 1180591620717411303424 does not fit"),
    ("tokens.python_bool", lambda: _tokens([5, True, 7]), ValueError, "tokens[1] = True is a boolean"),
    ("tokens.numpy_bool_in_list", lambda: _tokens([5, np.bool_(False)]), ValueError, "is a boolean"),
    ("tokens.object_huge", lambda: _tokens(np.array([1, 2**70], dtype=object)), ValueError,
     "tokens[1] = 1180591620717411303424 is not an integer representable in int64"),
    ("tokens.float", lambda: _tokens([1.0, 2.0]), ValueError, "document 5: tokens must be integer token ids"),
    ("tokens.bool", lambda: _tokens([True, False]), ValueError, "loss mask goes third"),
    ("tokens.string", lambda: _tokens(["a", "b"]), ValueError, "integer token ids"),
    ("tokens.2d", lambda: _tokens([[1, 2]]), ValueError, "must be 1-D"),
    ("mask.values", lambda: _tokens([1, 2, 3], [1, 2, 0]), ValueError, "loss_mask[1] = 2"),
    ("mask.float", lambda: _tokens([1, 2], [0.5, 1.0]), ValueError, "loss_mask must be booleans"),
    ("mask.length", lambda: _tokens([1, 2], [True]), ValueError, "loss mask of 1 entries for 2 tokens"),
    ("tokens.bfloat16_tensor", lambda: _tokens(_bfloat16([1, 2, 3])), ValueError,
     "document 5: tokens must hold integers, got a tensor of dtype torch.bfloat16"),
    ("mask.bfloat16_tensor", lambda: _tokens([1, 2], _bfloat16([1, 1])), ValueError,
     "document 5: loss_mask must hold integers or booleans, got a tensor of dtype torch.bfloat16"),
    # the None is named, not the valid True before it
    ("mask.none_entry", lambda: _tokens([1, 2, 3], [True, None, True]), ValueError,
     "document 5: loss_mask[1] = None is not an integer"),
    ("id.huge", lambda: list(_stream([(2**63, [1])], lookahead=0)), ValueError,
     "document id 9223372036854775808 does not fit in int64"),
    ("id.too_negative", lambda: list(_stream([(-2**63 - 1, [1])], lookahead=0)), ValueError, "does not fit in int64"),
    ("iter.finished", lambda: [list(s) for s in [_stream(DOCS[:3])] * 2], ValueError, "this stream has ended"),
]


def _superseded():
    stream = _stream()
    first = iter(stream)
    next(first)
    iter(stream)
    next(first)


def _iterated_then_handed_out():
    stream = _stream()
    before = iter(stream)
    stream.as_dataset()
    next(before)  # it would train the steps the DataLoader's worker trains


ITER_CASES = [("iter.before_as_dataset", _iterated_then_handed_out, ValueError, "superseded"),
              ("iter.superseded", _superseded, ValueError, "superseded by a later iter(), drain() or as_dataset()")]

CASES = STATE_CASES + TOKEN_CASES + ITER_CASES


@pytest.mark.parametrize("call, exc_type, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_stream_input_raises_a_clear_error(call, exc_type, fragment):
    _check(call, exc_type, fragment)


def test_the_good_state_loads_and_the_table_covers_every_state_field():
    stream = _stream()
    stream.load_state_dict(GOOD)
    assert next(iter(stream)).index == GOOD["step"]
    fields = {c[0].split(".")[2] for c in STATE_CASES if c[0].startswith("state.missing.")}
    assert fields == set(GOOD) - {"version"}
