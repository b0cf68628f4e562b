"""Every public entry point answers bad input with a clear error of the library's own.

One table per API: each case is (id, call, exception type, message fragment). A case passes
when the call raises that type, the message contains the fragment (which names the value or
what would be valid), and the exception was raised by this library's code, not by numpy,
json, torch or the standard library surfacing from inside. CLI cases call `wlb_opt.cli.main`
in-process and expect exit status 2, the fragment on stderr and no traceback; a handful run
the real `wlb-opt` process to check its exit status and stderr.

To add an API, append a list of case tuples and add it to `ALL_CASES`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import wlb_opt as wlb
import wlb_opt.cost_fit  # noqa: F401 (wlb.cost_fit in the tables)
from bad_input_cli_cases import CLI_CASES, SUBPROCESS_CASES, _write, cli_file_cases
from wlb_opt.cli import main

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_DIRS = tuple(str(ROOT / d) + os.sep for d in ("wlb_opt", "kernels", "solvers", "bench"))
INSTALLED = tuple(str(Path(m.__file__).parent) + os.sep for m in (wlb,))

COST = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), None, wlb.HardwareSpec.preset("cpu")).without_layout()
LAID_OUT = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(dp=2, cp=2, pp=2),
                                  wlb.HardwareSpec.preset("cpu"))
PLAN = wlb.solve_pack([5, 9, 3], 2, 10, COST)
NAN, INF = math.nan, math.inf


def _bad_counts(name: str, call, low: int = 1):
    """Cases for an integer parameter >= `low`: call(value) must name `name` and the limit."""
    frag = f"{name} must be an integer >= {low}"
    values = [("below", low - 1), ("negative", -7), ("float", 2.5), ("string", "4"), ("bool", True),
              ("nan", NAN)]
    return [(f"{name}={label}", (lambda v=v: call(v)), ValueError, frag) for label, v in values]


def _bad_seconds(name: str, call):
    frag = f"{name} must be a"
    values = [("zero", 0), ("negative", -1.0), ("nan", NAN), ("string", "1"), ("bool", True)]
    return [(f"{name}={label}", (lambda v=v: call(v)), ValueError, frag) for label, v in values]


BAD_LENGTHS = [
    ("zero", [5, 0], "positive token counts, got 0"),
    ("negative", [-3], "positive token counts, got -3"),
    ("fraction", [4.5], "must be integers, got 4.5"),
    ("nan", [NAN], "NaN/inf"),
    ("inf", [INF], "NaN/inf"),
    ("string", ["12"], "must be integer token counts, got '12' at index 0"),
    ("nested", [[1, 2], [3, 4]], "1-D sequence"),
    ("bool", [True, False], "must be integers, got dtype bool"),
    ("huge", [2**62], "below 2**62"),
    ("huge_float", [1e30], "below 2**62"),
    ("masked", np.ma.array([5, 9, 3], mask=[0, 1, 0]), "must not be a masked array"),
    ("uint64_huge", np.array([2**63 + 5], dtype=np.uint64), "below 2**62"),
    ("total_overflow", [2**61, 2**61, 2**61], "fewer than 2**62 tokens in total"),
    ("object", np.array([1, None], dtype=object), "must be integer token counts, got None at index 1"),
    ("complex", np.array([1 + 2j]), "must be integers, got dtype complex"),
]


# ---------------------------------------------------------------- specs
def _model(**kw):
    return wlb.ModelSpec(**{**dict(hidden=64, layers=2, heads=4, ffn=128), **kw})


def _hardware(**kw):
    base = dict(peak_tflops=100.0, gemm_efficiency=0.5, attn_efficiency=0.4, hbm_gbps=1000.0, nvlink_gbps=100.0,
                network_gbps=10.0)
    return wlb.HardwareSpec(**{**base, **kw})


SPEC_CASES = (
    [(f"ModelSpec.{f}={label}", (lambda f=f, v=v: _model(**{f: v})), ValueError, f"ModelSpec.{f} must be an integer")
     for f in ("hidden", "layers", "heads", "ffn", "vocab")
     for label, v in (("zero", 0), ("float", 64.0), ("string", "64"), ("bool", True))]
    + [("ModelSpec.kv_heads=3", lambda: _model(kv_heads=3), ValueError, "kv_heads"),
       ("ModelSpec.preset=bogus", lambda: wlb.ModelSpec.preset("bogus"), ValueError, "unknown ModelSpec preset"),
       ("ModelSpec.preset=int", lambda: wlb.ModelSpec.preset(7), ValueError, "unknown ModelSpec preset")]
    + [(f"ParallelSpec.{f}={label}", (lambda f=f, v=v: wlb.ParallelSpec(**{f: v})), ValueError,
        f"ParallelSpec.{f} must be an integer >= 1")
       for f in ("tp", "cp", "pp", "dp", "gpus_per_node")
       for label, v in (("zero", 0), ("negative", -2), ("float", 2.0), ("bool", False))]
    + [(f"HardwareSpec.{f}={label}", (lambda f=f, v=v: _hardware(**{f: v})), ValueError, f"HardwareSpec.{f} must be")
       for f in ("peak_tflops", "hbm_gbps", "nvlink_gbps", "network_gbps")
       for label, v in (("zero", 0.0), ("inf", INF), ("nan", NAN), ("string", "1"))]
    + [(f"HardwareSpec.{f}={label}", (lambda f=f, v=v: _hardware(**{f: v})), ValueError, "must be in (0, 1]")
       for f in ("gemm_efficiency", "attn_efficiency")
       for label, v in (("zero", 0.0), ("above_one", 1.5), ("nan", NAN), ("bool", True))]
    + [("HardwareSpec.preset=bogus", lambda: wlb.HardwareSpec.preset("tpu9"), ValueError, "unknown HardwareSpec preset")]
)


# ---------------------------------------------------------------- cost model
def _cost_dict(**changes):
    d = COST.to_dict()
    for key, value in changes.items():
        if key.startswith("coef_"):
            d["coef"]["fwd"][key[5:]] = value
        else:
            d[key] = value
    return d


def _layout(**overrides):
    import argparse

    from wlb_opt.cost_args import add_cost_args, layout_from_args

    parser = argparse.ArgumentParser()
    add_cost_args(parser, layout=("tp", "cp", "pp", "dp"))
    return layout_from_args(parser.parse_args([]), **overrides)


def _samples(fwd_s=None):
    from wlb_opt.cost_fit import Sample, sample_micro_batches

    batches = sample_micro_batches(256, 8, np.random.default_rng(0))
    return [Sample(d, float(d.sum()) * 1e-6 if fwd_s is None else fwd_s, 2e-6 * float(d.sum())) for d in batches]


def _fit(layers=1, fwd_s=None):
    return wlb.cost_fit.fit_terms(_samples(fwd_s), layers=layers)


def _validate_fit(layers=1):
    samples = _samples()
    return wlb.cost_fit.validate(wlb.cost_fit.fit_terms(samples), samples, layers=layers)


def _intervals(**kw):
    return wlb.cost_fit.coef_intervals(_samples(), **kw)


COST_CASES = (
    [(f"CostModel.coef.{term}={label}", (lambda term=term, v=v: wlb.CostModel.from_dict(_cost_dict(**{"coef_" + term: v}))),
      ValueError, f"CostModel.coef['fwd'][{term!r}] must be a finite number")
     for term in ("attn", "linear", "comm", "doc_const", "mb_const")
     for label, v in (("nan", NAN), ("inf", INF), ("negative", -1e-9), ("huge", 1e308), ("string", "1e-9"),
                      ("missing", None))]
    + [(f"CostModel.{field}={label}", (lambda field=field, v=v: wlb.CostModel.from_dict(_cost_dict(**{field: v}))),
        ValueError, f"CostModel.{field} must be")
       for field in ("attn_flops_per_pair", "attn_peak_flops")
       for label, v in (("nan", NAN), ("inf", INF), ("zero", 0.0), ("negative", -1.0), ("string", "1"))]
    + [(f"CostModel.attn_bwd_ratio={label}", (lambda v=v: wlb.CostModel.from_dict(_cost_dict(attn_bwd_ratio=v))),
        ValueError, "CostModel.attn_bwd_ratio must be") for label, v in (("nan", NAN), ("inf", INF), ("negative", -1))]
    + [(f"CostModel.tile={label}", (lambda v=v: wlb.CostModel.from_dict(_cost_dict(tile=v))), ValueError,
        "CostModel.tile must be an integer >= 1") for label, v in (("float", 128.0), ("zero", 0), ("string", "128"))]
    + [("CostModel.eff_scale=nan", lambda: wlb.CostModel.from_dict(_cost_dict(eff_scale=[NAN] * 5)), ValueError,
        "CostModel.eff_scale[0] must be"),
       ("CostModel.eff_scale=zero", lambda: wlb.CostModel.from_dict(_cost_dict(eff_scale=[0.0] * 5)), ValueError,
        "CostModel.eff_scale[0] must be"),
       ("CostModel.eff_q_len=decreasing", lambda: wlb.CostModel.from_dict(_cost_dict(eff_q_len=[5, 4, 3, 2, 1])),
        ValueError, "strictly increase"),
       ("CostModel.eff_q_len=float", lambda: wlb.CostModel.from_dict(_cost_dict(eff_q_len=[1.5, 2, 3, 4, 5])),
        ValueError, "CostModel.eff_q_len[0] must be an integer"),
       ("CostModel.eff_lengths_differ", lambda: wlb.CostModel.from_dict(_cost_dict(eff_scale=[1.0])), ValueError,
        "equal length"),
       ("CostModel.eff_scale=string", lambda: wlb.CostModel.from_dict(_cost_dict(eff_scale="1")), ValueError,
        "eff_scale must be a list"),
       ("CostModel.coef=list", lambda: wlb.CostModel.from_dict(_cost_dict(coef=[1, 2])), ValueError,
        "CostModel.coef needs dicts"),
       ("CostModel.coef_no_bwd", lambda: wlb.CostModel.from_dict(_cost_dict(coef={"fwd": COST.coef["fwd"]})),
        ValueError, "CostModel.coef needs dicts"),
       ("CostModel.unknown_field", lambda: wlb.CostModel.from_dict(_cost_dict(speed=3)), ValueError,
        "unknown fields ['speed']"),
       ("CostModel.missing_coef", lambda: wlb.CostModel.from_dict({k: v for k, v in COST.to_dict().items()
                                                                   if k != "coef"}),
        ValueError, "missing fields ['coef']"),
       ("CostModel.version", lambda: wlb.CostModel.from_dict(_cost_dict(format_version=9)), ValueError,
        "format_version 9"),
       ("CostModel.from_list", lambda: wlb.CostModel.from_dict([1, 2]), ValueError, "is a JSON object"),
       ("CostModel.parallel_cp0", lambda: wlb.CostModel.from_dict(
           {**LAID_OUT.to_dict(), "parallel": {**LAID_OUT.parallel.to_dict(), "cp": 0}}), ValueError,
        "ParallelSpec.cp must be an integer >= 1"),
       ("CostModel.parallel_unknown", lambda: wlb.CostModel.from_dict(
           {**LAID_OUT.to_dict(), "parallel": {"ep": 2}}), ValueError, "parallel:"),
       ("CostModel.parallel_string", lambda: wlb.CostModel.from_dict({**LAID_OUT.to_dict(), "parallel": "tp8"}),
        ValueError, "parallel must be an object"),
       ("CostModel.model_wrong", lambda: wlb.CostModel(coef=COST.coef, attn_flops_per_pair=1.0, model="7b"),
        ValueError, "CostModel.model must be a ModelSpec"),
       ("CostModel.degree_name", lambda: COST.degree("ep", 2), ValueError, "layout dimension must be one of"),
       ("CostModel.degree_mismatch", lambda: LAID_OUT.degree("dp", 4), ValueError, "dp=4 disagrees"),
       ("CostModel.degree_zero", lambda: COST.degree("dp", 0), ValueError, "dp must be an integer >= 1"),
       ("CostModel.phase", lambda: COST.doc_cost([5], phase="both"), ValueError, "phase must be one of"),
       ("CostModel.attention_tiles", lambda: COST.attention_tiles(5, 3), ValueError, "0 <= q_len <= kv_len"),
       ("CostModel.attention_latency_float", lambda: COST.attention_latency(2.7, 5), ValueError,
        "q_len must hold integers, got 2.7"),
       ("CostModel.attention_latency_string", lambda: COST.attention_latency("3", 5), ValueError,
        "q_len must be integer token counts"),
       ("CostModel.attention_latency_shapes", lambda: COST.attention_latency([1, 2, 3], [4, 5]), ValueError,
        "q_len and kv_len must have broadcastable shapes"),
       ("CostModel.linear_cost_negative", lambda: COST.linear_cost(-5), ValueError,
        "tokens must be finite token counts >= 0, got -5"),
       ("CostModel.linear_cost_string", lambda: COST.linear_cost("5"), ValueError, "tokens must be finite"),
       ("CostModel.from_dict.extra_phase",
        lambda: wlb.CostModel.from_dict({**COST.to_dict(), "coef": {**COST.to_dict()["coef"],
                                                                    "fwd_bwd": COST.to_dict()["coef"]["fwd"]}}),
        ValueError, "CostModel.coef has phases 'fwd' and 'bwd' only"),
       ("CostModel.from_dict.tile_huge", lambda: wlb.CostModel.from_dict({**COST.to_dict(), "tile": 2**40}),
        ValueError, "CostModel.tile must be an integer >= 1 and <= 65536"),
       ("CostModel.analytic_exposed", lambda: wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"),
                                                                      tp_comm_exposed=2.0),
        ValueError, "tp_comm_exposed"),
       ("CostModel.meta_none", lambda: dataclasses.replace(COST, meta=None), ValueError,
        "CostModel.meta must be a dict"),
       ("CostModel.efficiency_source_int", lambda: dataclasses.replace(COST, efficiency_source=5), ValueError,
        "CostModel.efficiency_source must be a string"),
       ("CostModel.attention_efficiency_string", lambda: COST.attention_efficiency("a"), ValueError,
        "q_len must be integer token counts"),
       ("CostModel.attention_efficiency_nan", lambda: COST.attention_efficiency(math.nan), ValueError,
        "q_len must hold integers, got nan"),
       ("CostModel.attention_efficiency_negative", lambda: COST.attention_efficiency(-5), ValueError,
        "q_len must be token counts >= 0, got -5"),
       ("CostModel.attention_latency_bool", lambda: COST.attention_latency([True, 3], [4, 4]), ValueError,
        "q_len must be integer token counts, got [True, 3]"),
       ("CostModel.linear_cost_bool", lambda: COST.linear_cost([True, 3]), ValueError,
        "tokens must be finite token counts >= 0, got [True, 3]"),
       ("attention_tiles.tile_negative", lambda: wlb.cost.attention_tiles(300, 300, -128), ValueError,
        "tile must be an integer >= 1, got -128"),
       ("attention_tiles.tile_bool", lambda: wlb.cost.attention_tiles(300, 300, True), ValueError,
        "tile must be an integer >= 1, got True"),
       ("cost_args.layout_float", lambda: _layout(dp=2.7), ValueError, "ParallelSpec.dp must be an integer >= 1, got 2.7"),
       ("cost_args.layout_bool", lambda: _layout(dp=True), ValueError, "ParallelSpec.dp must be an integer >= 1, got True"),
       ("cost_args.layout_string", lambda: _layout(pp="3"), ValueError, "ParallelSpec.pp must be an integer >= 1, got '3'"),
       ("cost_fit.fit_layers_zero", lambda: _fit(layers=0), ValueError, "fit_cost_model: layers must be an integer >= 1, got 0"),
       ("cost_fit.fit_layers_nan", lambda: _fit(layers=math.nan), ValueError, "layers must be an integer >= 1, got nan"),
       ("cost_fit.fit_layers_bool", lambda: _fit(layers=True), ValueError, "layers must be an integer >= 1, got True"),
       ("cost_fit.validate_layers_zero", lambda: _validate_fit(layers=0), ValueError,
        "validate: layers must be an integer >= 1, got 0"),
       ("cost_fit.intervals_n_fits_zero", lambda: _intervals(n_fits=0), ValueError,
        "coef_intervals: n_fits must be an integer >= 1, got 0"),
       ("cost_fit.intervals_quantiles_reversed", lambda: _intervals(quantiles=(90, 10)), ValueError,
        "quantiles must be (low, high) percentages with 0 <= low <= high <= 100, got (90, 10)"),
       ("cost_fit.sample_window_float", lambda: wlb.cost_fit.sample_micro_batches(100.0, 4, np.random.default_rng(0)),
        ValueError, "window must be an integer >= 16 (tokens)"),
       ("cost_fit.sample_rng_none", lambda: wlb.cost_fit.sample_micro_batches(100, 4, None), ValueError,
        "rng must be a numpy Generator"),
       ("cost_fit.sample_time_bool", lambda: _fit(fwd_s=True), ValueError,
        "measured fwd times must be positive and finite, got True")]
    + [(f"CostModel.doc_cost.{label}", (lambda v=v: COST.doc_cost(v)), ValueError, frag)
       for label, v, frag in BAD_LENGTHS[:8]]
    + [(f"CostModel.micro_batch_cost.{label}", (lambda v=v: COST.micro_batch_cost(v)), ValueError, frag)
       for label, v, frag in BAD_LENGTHS[:5]]
)


def _cost_file_case(label: str, text, fragment: str):
    def call(tmp_path):
        return wlb.CostModel.load(_write(tmp_path, f"{label}.json", text))
    return (f"CostModel.load.{label}", call, ValueError, fragment)


COST_FILE_CASES = [
    ("CostModel.load.missing", lambda tmp_path: wlb.CostModel.load(tmp_path / "nope.json"), ValueError,
     "does not exist"),
    ("CostModel.load.directory", lambda tmp_path: wlb.CostModel.load(tmp_path), ValueError, "is not a file"),
    _cost_file_case("not_json", "{coef:", "is not JSON"),
    _cost_file_case("binary", b"\xff\xfe\x00", "is not JSON"),
    _cost_file_case("list", "[1, 2, 3]", "is a JSON object"),
    _cost_file_case("string_coef", json.dumps(_cost_dict(coef_attn="1e-9")), "must be a finite number"),
    _cost_file_case("unknown_key", json.dumps(_cost_dict(bogus=1)), "unknown fields ['bogus']"),
    _cost_file_case("missing_key", json.dumps({k: v for k, v in COST.to_dict().items() if k != "attn_flops_per_pair"}),
                    "missing fields ['attn_flops_per_pair']"),
]


# ---------------------------------------------------------------- documents and length files
DOCS_CASES = (
    [(f"split_documents.lengths.{label}", (lambda v=v: wlb.split_documents(v, 8)), ValueError, frag)
     for label, v, frag in BAD_LENGTHS]
    + _bad_counts("window", lambda v: wlb.split_documents([5], v))
    + [("split_documents.too_many_pieces", lambda: wlb.split_documents([10**12], 1), ValueError,
        "would make 1000000000000 pieces"),
       ("split_documents.ids_size", lambda: wlb.split_documents([5, 6], 8, ids=[1]), ValueError,
        "same size as lengths"),
       ("split_documents.ids_float", lambda: wlb.split_documents([5, 6], 8, ids=[1.5, 2]), ValueError,
        "ids must be integers"),
       ("split_documents.ids_uint64", lambda: wlb.split_documents([5], 8, ids=np.array([2**63], np.uint64)),
        ValueError, "ids must fit in int64"),
       ("split_documents.ids_repeated", lambda: wlb.split_documents([5, 6, 7], 3, ids=[2, 1, 2]), ValueError,
        "ids must be distinct (one per document), got id 2 at positions 0 and 2")]
)


def _length_file_case(label: str, name: str, content, fragment: str, **kw):
    def call(tmp_path):
        path = tmp_path / name
        if isinstance(content, np.ndarray):
            np.save(path, content)
        elif content is not None:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return wlb.load_lengths(path, **kw)
    return (f"load_lengths.{label}", call, ValueError, fragment)


def _npz_as_npy(tmp_path):
    np.savez(tmp_path / "arch.npz", a=np.arange(3))
    os.replace(tmp_path / "arch.npz", tmp_path / "arch.npy")
    return wlb.load_lengths(tmp_path / "arch.npy")


LENGTH_FILE_CASES = [
    ("load_lengths.missing", lambda tmp_path: wlb.load_lengths(tmp_path / "none.txt"), ValueError, "does not exist"),
    ("load_lengths.directory", lambda tmp_path: wlb.load_lengths(tmp_path), ValueError, "is not a file"),
    ("load_lengths.none", lambda tmp_path: wlb.load_lengths(None), TypeError,
     "path must be a file path (str or os.PathLike), got NoneType"),
    ("load_lengths.npz_renamed", _npz_as_npy, ValueError, "arch.npy"),
    _length_file_case("npy_garbage", "g.npy", b"not a numpy file", "not a readable .npy"),
    _length_file_case("npy_float", "f.npy", np.array([1.5, 2.0]), "must be integers, got 1.5"),
    _length_file_case("npy_2d", "m.npy", np.ones((2, 2), np.int64), "1-D sequence"),
    _length_file_case("npy_negative", "n.npy", np.array([3, -1]), "positive token counts"),
    _length_file_case("txt_word", "w.txt", "12\nabc\n", "expected one integer length per line, got 'abc'"),
    _length_file_case("txt_fraction", "f.txt", "12.5\n", "expected one integer length per line"),
    _length_file_case("txt_line_of_file", "c.txt", "# a\n# b\n\n5\nxyz\n", "c.txt:5: expected one integer length per line"),
    _length_file_case("txt_beyond_float", "b.txt", f"{2**53 + 1}\n{2**62 + 1}\n", "below 2**62"),
    _length_file_case("txt_zero", "z.txt", "0\n", "positive token counts"),
    _length_file_case("txt_binary", "bin.txt", b"\xff\xfe\xfa", "not a text file"),
    _length_file_case("txt_1e30", "e.txt", "1e30\n", "below 2**62"),
    _length_file_case("jsonl_true", "t.jsonl", '{"length": true}\n', "must be an integer length or a string"),
    _length_file_case("jsonl_float", "f.jsonl", '{"length": 12.5}\n', "must be an integer length or a string"),
    _length_file_case("jsonl_null", "n.jsonl", '{"length": null}\n', "must be an integer length or a string"),
    _length_file_case("jsonl_empty_text", "e.jsonl", '{"text": "abcd"}\n{"text": ""}\n',
                      "e.jsonl:2: field 'text' is an empty string: a document of no tokens", field="text"),
    _length_file_case("jsonl_list", "l.jsonl", '{"length": [1, 2]}\n', "must be an integer length or a string"),
    _length_file_case("jsonl_bad_json", "b.jsonl", '{"length": 3}\n{oops\n', "b.jsonl:2: not valid JSON"),
    _length_file_case("jsonl_array_line", "a.jsonl", "[1, 2]\n", "expected a JSON object"),
    _length_file_case("jsonl_number_line", "num.jsonl", "7\n", "expected a JSON object"),
    _length_file_case("jsonl_no_field", "nf.jsonl", '{"len": 3}\n', "no field 'length'; fields are ['len']"),
    _length_file_case("jsonl_other_field", "o.jsonl", '{"length": 3}\n', "no field 'tokens'", field="tokens"),
    _length_file_case("jsonl_huge", "h.jsonl", '{"length": 100000000000000000000}\n', "below 2**62"),
    _length_file_case("jsonl_negative", "neg.jsonl", '{"length": -4}\n', "positive token counts"),
    _length_file_case("jsonl_digits_string", "s.jsonl", '{"length": 1200}\n{"length": "800"}\n',
                      "s.jsonl:2: field 'length' is the string '800', which would be read as a text of 3 characters"),
]


# ---------------------------------------------------------------- solve_pack
def _pack(lengths=(5, 9, 3), n_micro=2, max_tokens=10, cost=COST, method="wlb", **kw):
    return wlb.solve_pack(list(lengths) if isinstance(lengths, tuple) else lengths, n_micro, max_tokens, cost,
                          method, **kw)


PACK_CASES = (
    [(f"solve_pack.lengths.{label}", (lambda v=v: _pack(v, max_tokens=2**62)), ValueError, frag)
     for label, v, frag in BAD_LENGTHS]
    + _bad_counts("n_micro", lambda v: _pack(n_micro=v))
    + _bad_counts("max_tokens", lambda v: _pack(max_tokens=v))
    + _bad_counts("carried", lambda v: _pack(carried=v), low=0)[1:]
    + _bad_seconds("time_limit", lambda v: _pack(time_limit=v))
    + [("solve_pack.carried_out_of_range", lambda: _pack(carried=5), ValueError, "carried=5 is out of range"),
       ("solve_pack.method", lambda: _pack(method="magic"), ValueError, "unknown packing method 'magic'"),
       ("solve_pack.method_int", lambda: _pack(method=3), ValueError, "unknown packing method 3"),
       ("solve_pack.method_list", lambda: _pack(method=["wlb"]), ValueError, "unknown packing method ['wlb']"),
       ("solve_pack.cost_string", lambda: _pack(cost="7b"), ValueError, "cost must be a wlb_opt.CostModel"),
       ("solve_pack.cost_dict", lambda: _pack(cost={}), ValueError, "cost must be a wlb_opt.CostModel"),
       ("solve_pack.ids_size", lambda: _pack(ids=[1, 2]), ValueError, "same size as lengths (3)"),
       ("solve_pack.ids_float", lambda: _pack(ids=[1.0, 2.5, 3.0]), ValueError, "ids must be integers"),
       ("solve_pack.ids_uint64", lambda: _pack(ids=np.array([2**63, 1, 2], np.uint64)), ValueError,
        "ids must fit in int64"),
       ("solve_pack.ids_repeated", lambda: _pack(ids=[4, 4, 5]), ValueError, "id 4 with offset 0 is repeated"),
       ("solve_pack.pieces_overlap", lambda: _pack(ids=[4, 4, 5], offsets=[0, 3, 0]), ValueError,
        "pieces of document 4 overlap in the input: tokens [0, 5) at position 0 and [3, 12) at position 1"),
       ("solve_pack.offsets_negative", lambda: _pack(offsets=[0, -3, 0]), ValueError, "offsets must be >= 0"),
       ("solve_pack.offsets_size", lambda: _pack(offsets=[0]), ValueError, "offsets must be a 1-D sequence"),
       ("solve_pack.offsets_float", lambda: _pack(offsets=[0, 0.5, 0]), ValueError, "offsets must be integers"),
       ("solve_pack.dp_mismatch", lambda: _pack(cost=LAID_OUT, dp=3), ValueError, "dp=3 disagrees"),
       ("solve_pack.dp_zero", lambda: _pack(dp=0), ValueError, "dp must be an integer >= 1"),
       ("solve_pack.option_unknown", lambda: _pack(allow_defer=True), ValueError, "takes no option"),
       ("solve_pack.backend_without_milp", lambda: _pack(backend="highs"), ValueError,
        "backend='highs' chooses the solver of method='milp' ('cbc' or 'highs'); method='wlb' takes no backend"),
       ("solve_pack.too_long", lambda: _pack([50], max_tokens=10), ValueError, "50"),
       ("solve_pack.original_overflow", lambda: _pack(np.array([2**61, 2**61 - 1]), method="original",
                                                     max_tokens=2**62 - 1), ValueError, "in total"),
       ("solve_pack.seed", lambda: _pack(seed=-1), ValueError, "seed")]
)


# ---------------------------------------------------------------- plans
def _plan_dict(**changes):
    return {**PLAN.to_dict(), **changes}


PLAN_CASES = [
    ("PackPlan.from_dict.float_length", lambda: wlb.PackPlan.from_dict(_plan_dict(lengths=[5, 9, 3.5])), ValueError,
     "plan field lengths must hold integers, got 3.5"),
    ("PackPlan.from_dict.float_id", lambda: wlb.PackPlan.from_dict(_plan_dict(doc_ids=[0, 1.5, 2])), ValueError,
     "plan field doc_ids must hold integers"),
    ("PackPlan.from_dict.float_micro_batch", lambda: wlb.PackPlan.from_dict(
        _plan_dict(micro_batches=[[0.5], [1, 2]])), ValueError, "plan field micro_batches must hold integers"),
    ("PackPlan.from_dict.string_tokens", lambda: wlb.PackPlan.from_dict(_plan_dict(tokens=["5", "12"])), ValueError,
     "plan field tokens must hold integers"),
    ("PackPlan.from_dict.float_n_micro", lambda: wlb.PackPlan.from_dict(_plan_dict(n_micro=2.5)), ValueError,
     "n_micro must be an integer"),
    ("PackPlan.from_dict.zero_dp", lambda: wlb.PackPlan.from_dict(_plan_dict(dp=0)), ValueError,
     "dp must be an integer >= 1"),
    ("PackPlan.from_dict.negative_step", lambda: wlb.PackPlan.from_dict(_plan_dict(step=-2)), ValueError,
     "step must be an integer >= 0"),
    ("PackPlan.from_dict.missing", lambda: wlb.PackPlan.from_dict({k: v for k, v in PLAN.to_dict().items()
                                                                   if k != "lengths"}),
     ValueError, "malformed plan dict"),
    ("PackPlan.from_dict.version", lambda: wlb.PackPlan.from_dict(_plan_dict(format_version=7)), ValueError,
     "format_version 7"),
    ("PackPlan.from_dict.list", lambda: wlb.PackPlan.from_dict([1]), ValueError, "needs a dict"),
    ("PackPlan.arrival_size", lambda: PLAN.replace(arrival_step=[0]), ValueError, "arrival_step needs one entry"),
    ("PackPlan.from_dict.repeated_piece", lambda: wlb.PackPlan.from_dict(_plan_dict(doc_ids=[1, 1, 2])), ValueError,
     "id 1 with offset 0 is repeated in the plan"),
    ("PackPlan.from_dict.overlapping_pieces", lambda: wlb.PackPlan.from_dict(
        _plan_dict(doc_ids=[1, 1, 2], offsets=[0, 2, 0])), ValueError, "pieces of document 1 overlap in the plan"),
    ("PackPlan.from_dict.over_its_cap", lambda: wlb.PackPlan.from_dict(_plan_dict(max_tokens=1)), ValueError,
     "over the plan's own max_tokens=1"),
    ("PackPlan.from_dict.nested_loads", lambda: wlb.PackPlan.from_dict(_plan_dict(loads=[[1.0], [2.0]])), ValueError,
     "plan.loads must be a list, got an array of shape (2, 1)"),
    ("PackPlan.from_dict.nested_arrival", lambda: wlb.PackPlan.from_dict(
        _plan_dict(step=3, arrival_step=[[1], [0], [0]])), ValueError, "plan.arrival_step must be a list"),
    ("PackPlan.from_dict.string_loads", lambda: wlb.PackPlan.from_dict(_plan_dict(loads=["a", "b"])), ValueError,
     "loads must be numbers"),
    ("PackPlan.replace.float_step", lambda: PLAN.replace(step=2.7), ValueError, "step must be an integer >= 0, got 2.7"),
    ("PackPlan.replace.bool_step", lambda: PLAN.replace(step=True), ValueError, "step must be an integer >= 0, got True"),
    ("PackPlan.replace.replicas", lambda: PLAN.replace(replica_of=[5, 7]), ValueError,
     "plan.replica_of must give each of the plan's dp=1 replicas"),
    ("PackPlan.replace.tokens", lambda: PLAN.replace(tokens=[1, 1]), ValueError,
     "plan.tokens must be each micro-batch's tokens"),
    ("PackPlan.replace.dp", lambda: PLAN.replace(dp=0), ValueError, "dp must be an integer >= 1, got 0"),
    ("WLBPacker.candidate_thresholds.too_long", lambda: wlb.WLBPacker(1, 64).candidate_thresholds([5, 40, 500], 50),
     ValueError, "sample holds 500 tokens > max_tokens=64"),
    ("check_pack.plan_type", lambda: wlb.check_pack("plan", [5, 9, 3], 10), ValueError, "plan must be a wlb_opt.PackPlan"),
    ("check_pack.float_lengths", lambda: wlb.check_pack(PLAN, [5, 9, 3.5], 10), ValueError, "must be integers, got 3.5"),
    ("check_pack.max_tokens", lambda: wlb.check_pack(PLAN, [5, 9, 3], 0), ValueError, "max_tokens must be an integer"),
    *[(f"PackPlan.from_dict.{label}", (lambda ch=ch: wlb.PackPlan.from_dict({**PLAN.to_dict(), **ch})), ValueError,
       frag) for label, ch, frag in [
        ("piece_dropped", dict(micro_batches=[[1], [2]]), "pieces [0] are in none"),
        ("piece_twice", dict(micro_batches=[[1, 0], [0, 2]]), "pieces [0] in several"),
        ("index_out_of_range", dict(deferred=[9]), "pieces [9] out of range (it has 3 pieces)"),
        ("nested", dict(micro_batches=[[[1]], [[0, 2]]]), "micro_batches[0] must be a list of piece indices"),
        ("length_negative", dict(lengths=[5, -9, 3]), "lengths must be > 0"),
        ("offset_negative", dict(offsets=[0, -1, 0]), "offsets >= 0"),
        ("ids_short", dict(doc_ids=[0, 1]), "one entry per piece, got 2, 3 and 3"),
        ("replica_of_short", dict(replica_of=[0]), "one replica per micro-batch (2), got 1"),
        ("tokens_wrong", dict(tokens=[1, 1]), "plan.tokens[0] = 1"),
        ("loads_nan", dict(loads=[NAN, 1.0]), "plan.loads must be finite seconds >= 0"),
        ("micro_batches_count", dict(micro_batches=[[0, 1, 2]]), "plan has 1 micro-batches; dp x n_micro = 2")]],
    ("PackPlan.micro_batch_lengths.negative", lambda: PLAN.micro_batch_lengths(-1), ValueError,
     "j must be a micro-batch index in [0, 2), got -1"),
    ("PackPlan.micro_batch_lengths.float", lambda: PLAN.micro_batch_lengths(1.0), ValueError, "got 1.0"),
    ("PackPlan.replica_micro_batches.out_of_range", lambda: PLAN.replica_micro_batches(3), ValueError,
     "replica must be an integer in [0, 1), got 3"),
    ("ShardPlan.short_segment_share.tile", lambda: wlb.solve_shard([6, 4], 2).short_segment_share(tile=0), ValueError,
     "tile must be an integer >= 1"),
    ("check_pack.cost_type", lambda: wlb.check_pack(PLAN, [5, 9, 3], 10, cost="7b"), TypeError,
     "cost must be a wlb_opt.CostModel or None, got str"),
    ("check_pack.ids_size", lambda: wlb.check_pack(PLAN, [5, 9, 3], 10, ids=[0, 1]), ValueError, "same size as lengths"),
    ("check_pack.merged_pieces", lambda: wlb.check_pack(wlb.solve_pack([10], 1, 100, COST, ids=[0]), [5, 5], 100,
                                                        ids=[0, 0], offsets=[0, 5]),
     wlb.PlanError, "not the input's (id, offset, length)"),
    ("check_pack.split_piece", lambda: wlb.check_pack(wlb.solve_pack([5, 5], 1, 100, COST, ids=[0, 0], offsets=[0, 5]),
                                                      [10], 100, ids=[0]),
     wlb.PlanError, "not the input's (id, offset, length)"),
    ("check_pack.over_capacity", lambda: wlb.check_pack(PLAN, [5, 9, 3], 8), wlb.PlanError, "> max_tokens=8"),
    ("check_pack.wrapping_sum", lambda: wlb.check_pack(PLAN.replace(lengths=[2**62 - 1, 2**62 - 1, 3],
                                                                    tokens=[-2**63, 3]),
                                                       [2**61, 2**61, 3], 10), ValueError, "tokens"),
    ("ShardPlan.from_dict.version", lambda: wlb.ShardPlan.from_dict({"format_version": 0}), ValueError,
     "ShardPlan format_version 0"),
]


# ---------------------------------------------------------------- WLBPacker
_POLICY = {field.name for field in dataclasses.fields(wlb.PackerConfig)}


def _packer(**kw):
    """A WLBPacker from one set of keywords: the PackerConfig fields go in its config."""
    kw = {**dict(n_micro=2, max_tokens=100, cost=COST, thresholds=[50], max_delay=4), **kw}
    policy = {name: kw.pop(name) for name in list(kw) if name in _POLICY}
    return wlb.WLBPacker(**kw, config=wlb.PackerConfig(**policy))


def _packed():
    p = _packer()
    p.pack([60, 95, 95] + [45] * 7, list(range(10)))
    return p


def _state(**changes):
    s = json.loads(json.dumps(_packed().state_dict()))
    s.update(changes)
    return s


PACKER_CASES = (
    _bad_counts("n_micro", lambda v: _packer(n_micro=v))
    + _bad_counts("max_tokens", lambda v: _packer(max_tokens=v))
    + _bad_counts("max_delay", lambda v: _packer(max_delay=v))
    + _bad_counts("seed", lambda v: _packer(seed=v), low=0)[1:]
    + _bad_counts("max_backlog_tokens", lambda v: _packer(max_backlog_tokens=v), low=0)[1:]
    + _bad_counts("lookahead", lambda v: _packer(lookahead=v), low=0)
    + [("WLBPacker.max_tokens=auto_without_memory", lambda: _packer(max_tokens="auto"), ValueError,
        "max_tokens='auto' needs memory_bytes"),
       ("WLBPacker.memory_bytes_without_auto", lambda: _packer(memory_bytes=2**30), ValueError,
        "memory_bytes is only read with max_tokens='auto'"),
       ("WLBPacker.memory_bytes_too_small", lambda: _packer(max_tokens="auto", cost=LAID_OUT, memory_bytes=1),
        ValueError, "memory_bytes=1 cannot hold one token"),
       ("WLBPacker.max_tokens=string", lambda: _packer(max_tokens="big"), ValueError,
        "max_tokens must be an integer >= 1"),
       ("WLBPacker.state_other_lookahead",
        lambda: _packer(lookahead=2).load_state_dict(_packed().state_dict()), ValueError,
        "config.lookahead=0 does not match"),
       ("WLBPacker.thresholds=inf", lambda: _packer(thresholds=[INF]), ValueError, "thresholds[0] must be a positive"),
       ("WLBPacker.thresholds=nan", lambda: _packer(thresholds=[NAN]), ValueError, "thresholds[0] must be a positive"),
       ("WLBPacker.thresholds=fraction", lambda: _packer(thresholds=[10.5]), ValueError, "thresholds[0]"),
       ("WLBPacker.thresholds=zero", lambda: _packer(thresholds=[0]), ValueError, "thresholds[0]"),
       ("WLBPacker.thresholds=decreasing", lambda: _packer(thresholds=[60, 50]), ValueError, "strictly increasing"),
       ("WLBPacker.thresholds=string", lambda: _packer(thresholds="manual"), ValueError, "'auto' or an increasing"),
       ("WLBPacker.thresholds=int", lambda: _packer(thresholds=5), ValueError, "'auto' or an increasing"),
       ("WLBPacker.n_queues_mismatch", lambda: _packer(n_queues=3), ValueError, "does not match the 1 thresholds"),
       ("WLBPacker.n_queues_zero", lambda: _packer(thresholds="auto", n_queues=0), ValueError,
        "n_queues must be an integer >= 1"),
       ("WLBPacker.cost_string", lambda: _packer(cost="7b"), ValueError, "cost must be a wlb_opt.CostModel"),
       ("WLBPacker.dp_mismatch", lambda: _packer(cost=LAID_OUT, dp=4), ValueError, "dp=4 disagrees"),
       ("WLBPacker.method_original", lambda: _packer(method="original"), ValueError, "cannot run method='original'"),
       ("WLBPacker.method_unknown", lambda: _packer(method="fast"), ValueError, "unknown packing method 'fast'"),
       ("WLBPacker.release", lambda: _packer(release="eager"), ValueError, "release must be one of"),
       ("WLBPacker.balance_tolerance", lambda: _packer(balance_tolerance=0.5), ValueError, "balance_tolerance"),
       ("WLBPacker.balance_tolerance_nan", lambda: _packer(balance_tolerance=NAN), ValueError, "balance_tolerance"),
       ("WLBPacker.delay_budget", lambda: _packer(delay_budget=-1), ValueError, "delay_budget"),
       ("WLBPacker.delay_budget_inf", lambda: _packer(delay_budget=INF), ValueError, "delay_budget")]
    + [(f"WLBPacker.pack.{label}", (lambda v=v: _packer().pack(v)), ValueError, frag)
       for label, v, frag in BAD_LENGTHS]
    + [("WLBPacker.pack.too_long", lambda: _packer().pack([150]), ValueError, "150 tokens > max_tokens=100"),
       ("WLBPacker.pack.ids_repeated", lambda: _packer().pack([5, 6], [1, 1]), ValueError, "repeated within"),
       ("WLBPacker.pack.pieces_overlap", lambda: _packer().pack([5, 6], [1, 1], [5, 0]), ValueError,
        "pieces of document 1 overlap within the batch: tokens [0, 6) at position 1 and [5, 10) at position 0"),
       ("WLBPacker.pack.ids_held", lambda: (lambda p: p.pack([5], [int(p.queued_ids()[0])]))(_packed()), ValueError,
        "already held by the packer"),
       ("WLBPacker.pack.ids_size", lambda: _packer().pack([5, 6], [1]), ValueError, "same size as lengths"),
       ("WLBPacker.pack.ids_uint64", lambda: _packer().pack([5], np.array([2**64 - 1], np.uint64)), ValueError,
        "ids must fit in int64"),
       ("WLBPacker.pack.offsets_negative", lambda: _packer().pack([5], [1], [-1]), ValueError, "offsets must be >= 0"),
       ("WLBPacker.pack.overload", lambda: _packer(max_backlog_tokens=100).pack([40] * 10), ValueError,
        "overload at step 0"),
       ("WLBPacker.calibrate_late", lambda: _packed().calibrate([5, 50, 90]), ValueError, "before the first step"),
       ("WLBPacker.calibrate_batch_over_capacity",
        lambda: _packer(thresholds="auto").calibrate([5, 60, 70, 90, 10, 20, 30], 300), ValueError,
        "tokens_per_batch=300 is more than the packer can place in one step (1 x 2 micro-batches x max_tokens=100 = "
        "200)"),
       ("WLBPacker.candidate_thresholds_batch", lambda: _packer().candidate_thresholds([5, 60], 0), ValueError,
        "tokens_per_batch must be an integer >= 1"),
       ("PackerConfig.thresholds_dict", lambda: wlb.PackerConfig(thresholds={50: 1}), ValueError,
        "thresholds must be None, 'auto' or an increasing list of positive lengths, got dict"),
       ("PackerConfig.thresholds_bytes", lambda: wlb.PackerConfig(thresholds=b"\x05\x10"), ValueError, "got bytes"),
       ("PackerConfig.thresholds_set", lambda: wlb.PackerConfig(thresholds={5, 10}), ValueError, "got set"),
       ("WLBPacker.candidate_thresholds_empty", lambda: _packer().candidate_thresholds([], 100), ValueError,
        "sample is empty"),
       ("WLBPacker.load_state.version", lambda: _packer().load_state_dict(_state(version=1)), ValueError,
        "state version 1"),
       ("WLBPacker.load_state.not_dict", lambda: _packer().load_state_dict([1, 2]), ValueError,
        "state must be the dict that WLBPacker.state_dict() returns, got list"),
       ("WLBPacker.load_state.none", lambda: _packer().load_state_dict(None), ValueError,
        "state must be the dict that WLBPacker.state_dict() returns, got NoneType"),
       ("WLBPacker.load_state.config", lambda: _packer(max_tokens=120).load_state_dict(_state()), ValueError,
        "config.max_tokens=100"),
       ("WLBPacker.load_state.thresholds", lambda: _packer(thresholds=[40]).load_state_dict(_state()), ValueError,
        "thresholds=[50]"),
       ("WLBPacker.load_state.step_string", lambda: _packer().load_state_dict(_state(step="1")), ValueError,
        "field step must be an integer"),
       ("WLBPacker.load_state.step_negative", lambda: _packer().load_state_dict(_state(step=-1)), ValueError,
        "field step must be an integer"),
       ("WLBPacker.load_state.duplicate", lambda: _packer().load_state_dict(
           _state(carry=_state()["carry"] * 2)), ValueError, "twice"),
       ("WLBPacker.load_state.float_length", lambda: _packer().load_state_dict(
           _state(carry=[[90, 0, 90.9, 0]])), ValueError, "length must be an integer"),
       ("WLBPacker.load_state.future_arrival", lambda: _packer().load_state_dict(
           _state(carry=[[90, 0, 45, 3]])), ValueError, "arrival"),
       ("WLBPacker.load_state.over_cap", lambda: _packer().load_state_dict(
           _state(carry=[[90, 0, 101, 0]])), ValueError, "length must be an integer in [1, 100]"),
       ("WLBPacker.load_state.nan_stats", lambda: _packer().load_state_dict(_state(imbalance=[NAN])), ValueError,
        "imbalance[0] must be a finite"),
       ("WLBPacker.load_state.missing", lambda: _packer().load_state_dict(
           {k: v for k, v in _state().items() if k != "carry"}), ValueError, "malformed"),
       ("WLBPacker.load_state.limit", lambda: _packer().load_state_dict(_state(), max_backlog_tokens=-5), ValueError,
        "max_backlog_tokens must be an integer >= 0")]
)


# ---------------------------------------------------------------- solve_shard
def _shard(lengths=(30, 20, 10), cp=2, strategy="per_doc", **kw):
    return wlb.solve_shard(list(lengths) if isinstance(lengths, tuple) else lengths, cp, strategy, COST, **kw)


def _shard_dict_with(**changes):
    """ShardPlan.from_dict of a per_doc plan of two documents over 2 ranks with fields changed."""
    return wlb.ShardPlan.from_dict({**wlb.solve_shard([6, 4], 2, "per_doc").to_dict(), **changes})


def _shard_dict(edit):
    """ShardPlan.from_dict of a per_doc plan of two documents over 2 ranks, its chunk rows
    (rank, doc, start, length) edited by `edit`."""
    d = wlb.solve_shard([6, 4], 2, "per_doc").to_dict()
    edit(d["chunks"])
    return wlb.ShardPlan.from_dict(d)


def _split_rank1_row(chunks):
    """Rank 1's chunk of document 0 as two contiguous rows (the canonical table merges them)."""
    at = chunks.index([1, 0, 2, 3])
    chunks[at:at + 1] = [[1, 0, 2, 1], [1, 0, 3, 2]]


SHARD_CASES = (
    [(f"solve_shard.lengths.{label}", (lambda v=v: _shard(v)), ValueError, frag) for label, v, frag in BAD_LENGTHS]
    + _bad_counts("cp", lambda v: _shard(cp=v))
    + _bad_counts("workers", lambda v: _shard(strategy="cpsat", workers=v))
    + _bad_seconds("time_limit", lambda v: _shard(strategy="cpsat", time_limit=v))
    + [("ShardPlan.from_dict.rank", lambda: _shard_dict(lambda c: c[-1].__setitem__(0, 2)), ValueError,
        "chunk row 5 [2, 1, 1, 2] (rank, doc, start, length) needs rank in [0, 2)"),
       ("ShardPlan.from_dict.dropped_row", lambda: _shard_dict(lambda c: c.pop()), ValueError,
        "the chunks of document 1 do not tile its 4 tokens exactly"),
       ("ShardPlan.from_dict.overlap", lambda: _shard_dict(lambda c: c[0].__setitem__(3, 3)), ValueError,
        "the chunks of document 0 do not tile its 6 tokens exactly"),
       # the same rows in another order tile the documents too, but each rank's rows are read in order
       ("ShardPlan.from_dict.reordered_rows", lambda: _shard_dict(lambda c: c.reverse()), ValueError,
        "chunks must be in the order ShardPlan.to_dict writes them"),
       ("ShardPlan.from_dict.unmerged_rows", lambda: _shard_dict(_split_rank1_row), ValueError,
        "chunks must be in the order ShardPlan.to_dict writes them"),
       *[(f"ShardPlan.from_dict.{label}", (lambda ch=ch: _shard_dict_with(**ch)), ValueError, frag)
         for label, ch, frag in [
             ("length_float", dict(lengths=[6, 4.9]), "ShardPlan lengths must hold integers, got 4.9"),
             ("cp_string", dict(cp="2"), "cp must be an integer >= 1, got '2'"),
             ("cp_bool", dict(cp=True), "cp must be an integer >= 1, got True"),
             ("offset_negative", dict(offsets=[-5, 0]), "offsets >= 0"),
             ("offsets_short", dict(offsets=[0]), "1 offsets for 2 pieces"),
             ("loads_short", dict(loads=[1.0]), "loads must be 2 finite seconds >= 0 (one per rank)"),
             ("loads_nan", dict(loads=[NAN, 1.0]), "loads must be 2 finite seconds"),
             ("loads_strings", dict(loads=["1.5", "2"]), "loads must be a list of numbers (seconds, one per rank), "
                                                         "got ['1.5', '2']"),
             ("loads_bools", dict(loads=[True, False]), "loads must be a list of numbers"),
             ("lengths_nested", dict(lengths=[[6, 4]]), "lengths and offsets must be flat lists, got shapes (1, 2)"),
             ("chunks_ragged", dict(chunks=[[0, 0, 0]]), "chunks must be rows of"),
             ("info_none", dict(info=None), "malformed shard dict"),
             ("strategy_int", dict(strategy=3), "strategy must be a string")]],
       ("ShardPlan.from_dict.not_a_dict", lambda: wlb.ShardPlan.from_dict(None), ValueError,
        "ShardPlan.from_dict needs a dict"),
       ("solve_shard.strategy", lambda: _shard(strategy="zigzag"), ValueError, "strategy must be one of"),
       ("solve_shard.cost", lambda: wlb.solve_shard([5], 2, "per_doc", "7b"), ValueError,
        "cost must be a wlb_opt.CostModel"),
       ("solve_shard.cp_mismatch", lambda: wlb.solve_shard([5], 4, "per_doc", LAID_OUT), ValueError, "cp=4 disagrees"),
       ("solve_shard.token_skew", lambda: _shard(token_skew=-0.5), ValueError, "token_skew must be a number >= 0"),
       ("solve_shard.token_skew_string", lambda: _shard(token_skew="0.1"), ValueError, "token_skew"),
       ("solve_shard.offsets", lambda: _shard(offsets=[0, -1, 0]), ValueError, "offsets must be >= 0"),
       ("solve_shard.seed", lambda: _shard(strategy="cpsat", seed=-1), ValueError, "seed must be an integer >= 0"),
       # a step whose micro-batches are all empty still has its arguments checked
       ("solve_shards.empty_plan_cp", lambda: wlb.solve_shards(wlb.solve_pack([], 2, 10, COST), cp=-1), ValueError,
        "cp must be an integer >= 1, got -1"),
       ("solve_shards.workers", lambda: wlb.solve_shards(PLAN, 2, "hybrid", workers=10**9), ValueError,
        "workers must be an integer >= 1 and <= 10000, got 1000000000"),
       ("solve_shards.seed", lambda: wlb.solve_shards(PLAN, 2, "hybrid", seed=2**40), ValueError,
        "seed must be an integer >= 0 and <= 2147483647"),
       ("solve_shards.cpsat_unknown_option", lambda: wlb.solve_shards(PLAN, 2, "cpsat", foo=1), ValueError,
        "unknown options ['foo']; solve_shard takes token_skew, time_limit, workers, seed"),
       ("solve_shards.empty_plan_cost", lambda: wlb.solve_shards(wlb.solve_pack([], 2, 10, COST), cost="7b"),
        ValueError, "cost must be a wlb_opt.CostModel"),
       # a hand-made plan: its piece indices and lengths are the plan's, named as such
       ("solve_shards.piece_index", lambda: wlb.solve_shards(PLAN.replace(micro_batches=([0], [7])), 2), ValueError,
        "plan.micro_batches[1] holds piece index 7, outside 0 .. 2"),
       ("solve_shards.negative_piece_index", lambda: wlb.solve_shards(PLAN.replace(micro_batches=([0], [-1])), 2),
        ValueError, "plan.micro_batches[1] holds piece index -1"),
       ("solve_shards.zero_length", lambda: wlb.solve_shards(PLAN.replace(lengths=[5, 0, 3]), 2, "cpsat"), ValueError,
        "plan.lengths must be positive token counts, got 0 at index 1")]
)


# ---------------------------------------------------------------- simulator
SIM_CASES = [
    ("imbalance.nan", lambda: wlb.imbalance([NAN, 1.0]), ValueError,
     "loads must be finite numbers >= 0 (one per micro-batch), got nan at index 0"),
    ("imbalance.negative", lambda: wlb.imbalance([1.0, -2.0]), ValueError, "got -2.0 at index 1"),
    ("imbalance.none", lambda: wlb.imbalance(None), ValueError, "loads must be a sequence of finite numbers"),
    ("imbalance.string", lambda: wlb.imbalance("ab"), ValueError, "got 'ab'"),
    ("simulate_step.cost_string", lambda: wlb.simulate_step(PLAN, None, "7b"), ValueError,
     "cost must be a wlb_opt.CostModel"),
    ("simulate_step.parallel", lambda: wlb.simulate_step(PLAN, None, COST, "pp4"), ValueError,
     "parallel must be a ParallelSpec"),
    ("simulate_step.shards_count", lambda: wlb.simulate_step(PLAN, [None], COST), ValueError,
     "shards must hold one ShardPlan per micro-batch"),
    ("simulate_step.dp", lambda: wlb.simulate_step(PLAN, None, COST, wlb.ParallelSpec(dp=2)), ValueError,
     "plan has dp=1"),
    ("simulate_step.schedule", lambda: wlb.simulate_step(PLAN, None, COST, schedule="zero-bubble"), ValueError,
     "schedule"),
    ("simulate_pipeline.schedule", lambda: wlb.simulate_pipeline(np.ones((2, 2)), np.ones((2, 2)), "gpipe2"),
     ValueError, "schedule"),
    ("simulate_pipeline.shape", lambda: wlb.simulate_pipeline(np.ones((2, 2)), np.ones((3, 2))), ValueError, "shape"),
    ("simulate_pipeline.ragged", lambda: wlb.simulate_pipeline([[1, 2], [3]], [[1, 2], [3]]), ValueError,
     "fwd must be a rectangular array of seconds (every row as long)"),
    ("compare_to_measured.sim", lambda: __import__("wlb_opt.simulate").simulate.compare_to_measured("x", 1.0),
     TypeError, "sim must be a SimResult"),
    ("simulate_pipeline.nan", lambda: wlb.simulate_pipeline(np.full((2, 2), NAN), np.ones((2, 2))), ValueError,
     "finite"),
    ("simulate_pipeline.negative", lambda: wlb.simulate_pipeline(-np.ones((2, 2)), np.ones((2, 2))), ValueError,
     ">= 0"),
    ("simulate_pipeline.virtual", lambda: wlb.simulate_pipeline(np.ones((2, 2)), np.ones((2, 2)), "interleaved",
                                                                virtual_stages=0), ValueError, "virtual_stages"),
    ("simulate_rendezvous.virtual", lambda: wlb.simulate_rendezvous(np.ones((2, 2)), np.ones((2, 2)), 0), ValueError,
     "virtual_stages"),
    ("simulate_rendezvous.nan", lambda: wlb.simulate_rendezvous(np.full((2, 2), NAN), np.ones((2, 2))), ValueError,
     "finite"),
]


# ---------------------------------------------------------------- kernels and executor (torch)
def _torch_cases():
    torch = pytest.importorskip("torch")
    from wlb_opt.executor import (check_same_plan, context_parallel_attention, p2p_schedule, split_stages, TinyLM,
                                  make_mesh)
    from wlb_opt.kernels import doc_attention, segments_from_lengths
    from wlb_opt.kernels.launch import load_tuned

    q = torch.randn(32, 2, 16)
    seg = np.array([[0, 32, 0, 32]])

    def attn(q=q, k=q, v=q, segments=seg, **kw):
        return doc_attention(q, k, v, segments, **kw)

    def cp_attn(q=q, k=q, v=q, **kw):  # one CP rank, no process group: the checks doc_attention makes
        return context_parallel_attention(q, k, v, wlb.solve_shard([20, 12], 1, "per_doc"), **kw)

    cp_cases = [
        ("context_parallel_attention.scale_nan", lambda: cp_attn(softmax_scale=NAN), ValueError,
         "softmax_scale must be a finite number > 0"),
        ("context_parallel_attention.scale_zero", lambda: cp_attn(softmax_scale=0.0), ValueError,
         "softmax_scale must be a finite number > 0"),
        ("context_parallel_attention.heads", lambda: cp_attn(q=torch.randn(32, 3, 16), k=torch.randn(32, 2, 16),
                                                              v=torch.randn(32, 2, 16)), ValueError,
         "query heads (3) must be a multiple of key/value heads (2)"),
        ("context_parallel_attention.head_dims", lambda: cp_attn(k=torch.randn(32, 2, 8), v=torch.randn(32, 2, 8)),
         ValueError, "head dims differ: q has 16, k/v have 8"),
        ("context_parallel_attention.dtypes", lambda: cp_attn(q=q.double()), ValueError, "q, k, v must share a dtype"),
        ("context_parallel_attention.int_tensors", lambda: cp_attn(q=q.long(), k=q.long(), v=q.long()), ValueError,
         "q has dtype torch.int64"),
        ("context_parallel_attention.triton_fp64", lambda: cp_attn(q=q.double(), k=q.double(), v=q.double(),
                                                                   backend="triton"), ValueError,
         "q has dtype torch.float64"),
        ("context_parallel_attention.deterministic", lambda: cp_attn(deterministic="yes"), TypeError,
         "deterministic must be a bool"),
    ]

    model = TinyLM(vocab=32, dim=16, layers=2, heads=2, kv_heads=1, ffn=32)
    return (
        [("doc_attention.int64_wraps", lambda: attn(segments=torch.tensor([[0, 16, 2**32, 16]]), backend="triton"),
          ValueError, "segment values must fit in int32"),
         ("doc_attention.k_len_wraps", lambda: attn(segments=torch.tensor([[0, 16, 0, 2**32 + 16]]), backend="triton"),
          ValueError, "segment values must fit in int32"),
         ("doc_attention.numpy_q_auto", lambda: attn(q=q.numpy()), TypeError, "q must be a torch.Tensor"),
         ("doc_attention.numpy_k_torch", lambda: attn(k=q.numpy(), backend="torch"), TypeError,
          "k must be a torch.Tensor"),
         ("doc_attention.backend", lambda: attn(backend="cuda"), ValueError, "backend must be one of"),
         ("doc_attention.shape", lambda: attn(q=q[0]), ValueError, "q must have shape [T, H, D]"),
         ("doc_attention.dtype", lambda: attn(q=q.double(), k=q.double(), v=q.double(), backend="triton"), ValueError,
          "has dtype torch.float64"),
         ("doc_attention.kv_shape", lambda: attn(v=q[:16]), ValueError, "k and v must have the same shape"),
         ("doc_attention.heads", lambda: attn(q=torch.randn(32, 3, 16)), ValueError, "must be a multiple"),
         ("doc_attention.segments_shape", lambda: attn(segments=np.array([0, 32, 0, 32])), ValueError, "shape (S, 4)"),
         ("doc_attention.segments_float", lambda: attn(segments=np.array([[0.0, 32, 0, 32]])), ValueError,
          "segments must hold integers"),
         ("doc_attention.segments_past_end", lambda: attn(segments=np.array([[0, 33, 0, 33]])), ValueError,
          "past the 32 rows"),
         ("doc_attention.segments_overlap", lambda: attn(segments=np.array([[0, 16, 0, 16], [8, 8, 0, 16]])),
          ValueError, "overlapping query ranges"),
         ("doc_attention.q_longer_than_k", lambda: attn(segments=np.array([[0, 16, 0, 8]])), ValueError,
          "q_len must be <= k_len"),
         ("doc_attention.float_tensor_segments", lambda: attn(segments=torch.zeros(1, 4)), ValueError,
          "integer tensor"),
         ("doc_attention.scale_nan", lambda: attn(softmax_scale=NAN), ValueError, "softmax_scale must be a finite"),
         ("doc_attention.scale_inf", lambda: attn(softmax_scale=INF), ValueError, "softmax_scale must be a finite"),
         ("doc_attention.scale_zero", lambda: attn(softmax_scale=0.0), ValueError, "softmax_scale must be a finite"),
         ("doc_attention.scale_string", lambda: attn(softmax_scale="0.1"), ValueError, "softmax_scale"),
         ("doc_attention.scale_past_fp32", lambda: attn(softmax_scale=1e39), ValueError,
          "softmax_scale must be a finite number > 0 (or None for 1/sqrt(D)) that fp32 holds, got 1e+39"),
         ("doc_attention.deterministic_torch", lambda: attn(deterministic="no", backend="torch"), ValueError,
          "deterministic must be True or False, got 'no'"),
         ("doc_attention.return_lse", lambda: attn(return_lse="no"), ValueError,
          "return_lse must be True or False, got 'no'"),
         ("segments_from_lengths.float", lambda: segments_from_lengths([2.7, 3.2]), ValueError,
          "document lengths must be a 1-D sequence of integers, got [2.7, 3.2]"),
         ("segments_from_lengths.bool", lambda: segments_from_lengths([True, 3]), ValueError,
          "document lengths must be a 1-D sequence of integers"),
         ("segments_from_lengths.nested", lambda: segments_from_lengths([[1, 2], [3, 4]]), ValueError,
          "document lengths must be a 1-D sequence of integers"),
         ("load_tuned.block_zero", lambda: load_tuned({"fwd/fp16/64/1/1024/1024": [0, 64, 4, 2]}), ValueError,
          "is not [block_m, block_n, num_warps, num_stages]"),
         ("load_tuned.block_not_pow2", lambda: load_tuned({"fwd/fp16/64/1/1024/1024": [48, 64, 4, 2]}), ValueError,
          "block sizes powers of two >= 16"),
         ("load_tuned.float", lambda: load_tuned({"fwd/fp16/64/1/1024/1024": [64.9, 64, 4, 2]}), ValueError,
          "is not [block_m, block_n, num_warps, num_stages]"),
         ("load_tuned.kernel", lambda: load_tuned({"fwdd/fp16/64/1/1024/1024": [64, 64, 4, 2]}), ValueError,
          "names kernel 'fwdd'"),
         ("load_tuned.dtype", lambda: load_tuned({"fwd/bfloat16/64/1/1024/1024": [64, 64, 4, 2]}), ValueError,
          "names dtype 'bfloat16'"),
         ("load_tuned.bucket", lambda: load_tuned({"fwd/fp16/64/1/1000/1024": [64, 64, 4, 2]}), ValueError,
          "power-of-two q and k buckets"),
         ("p2p_schedule.pp", lambda: p2p_schedule(0, 4), ValueError, "pp"),
         ("p2p_schedule.n_micro", lambda: p2p_schedule(2, -1), ValueError, "n_micro"),
         ("p2p_schedule.virtual", lambda: p2p_schedule(2, 4, 0), ValueError, "virtual_stages"),
         ("split_stages.virtual", lambda: split_stages(model, 2, 0), ValueError, "virtual_stages"),
         ("split_stages.too_many", lambda: split_stages(model, 4, 2), ValueError, "cannot split 2 blocks into 8"),
         ("make_mesh.not_initialised", lambda: make_mesh(cp=2), ValueError, "needs torch.distributed initialised"),
         ("check_same_plan.plan", lambda: check_same_plan("plan"), ValueError, "plan must be a wlb_opt.PackPlan"),
         ("check_same_plan.shards", lambda: check_same_plan(PLAN, shards=3), ValueError, "shards must be")]
        + cp_cases
    )


# ---------------------------------------------------------------- WLBStream
def _stream(docs=((0, [1, 2]),), tokens_per_step=100, **kw):
    packer = wlb.WLBPacker(2, 64, config=wlb.PackerConfig(thresholds=[], **kw.pop("packer", {})))
    return wlb.WLBStream(list(docs), packer, tokens_per_step, **kw)


def _drain_stream(docs, **kw):
    return list(_stream(docs, **kw))


STREAM_CASES = (
    _bad_counts("tokens_per_step", lambda v: _stream(tokens_per_step=v))
    + [("WLBStream.window_zero", lambda: _stream(window=0), ValueError, "window must be an integer >= 1"),
       ("WLBStream.over_capacity", lambda: _stream(tokens_per_step=10**9), ValueError,
        "more than the packer can place"),
       ("WLBStream.window_over_max_tokens", lambda: _stream(window=65), ValueError,
        "longer than the packer's max_tokens"),
       ("WLBStream.strategy", lambda: _stream(strategy="best"), ValueError, "strategy must be one of"),
       ("WLBStream.cp_mismatch", lambda: _stream(cp=0), ValueError, "cp"),
       ("WLBStream.packer_type", lambda: wlb.WLBStream([(0, [1])], "packer", 100), ValueError,
        "packer must be a wlb_opt.WLBPacker"),
       ("WLBStream.packer_used", lambda: wlb.WLBStream([(0, [1])], _packed(), 100), ValueError,
        "packer has already been given 1 batches: a stream plans from a fresh packer"),
       ("WLBStream.documents_string", lambda: _drain_stream("abc"), ValueError, "must be (doc_id, tokens)"),
       ("WLBStream.tokens_none", lambda: _drain_stream([(0, None)]), ValueError,
        "document 0: tokens must be a 1-D sequence of token ids, got NoneType None"),
       ("WLBStream.empty_document", lambda: _drain_stream([(0, [1, 2]), (1, [])]), ValueError,
        "document 1 (item 1) has no tokens"),
       ("WLBStream.duplicate_id", lambda: _drain_stream([(0, [1, 2]), (0, [3])]), ValueError,
        "id 0 with offset 0 is repeated within the batch"),
       ("WLBStream.lookahead_duplicate_id",  # batch 1 repeats an id the lookahead buffer holds
        lambda: _drain_stream([(0, [1] * 60), (0, [3])], tokens_per_step=60, window=60, packer=dict(lookahead=2)),
        ValueError, "document id 0 (offset 0) is already held by the stream"),
       ("WLBStream.state_version", lambda: _stream().load_state_dict({"version": 99}), ValueError,
        "not a WLBStream state"),
       ("WLBStream.from_dataset_iterator", lambda: wlb.WLBStream.from_dataset(iter([]), _packer(), 100), ValueError,
        "map-style"),
       ("WLBStream.from_dataset_lengths", lambda: wlb.WLBStream.from_dataset([[1], [2]], _packer(), 100, lengths=[1]),
        ValueError, "lengths has 1 entries"),
       ("WLBStream.from_dataset_dict_keys",
        lambda: list(wlb.WLBStream.from_dataset({5: [1, 2], 7: [3]}, wlb.WLBPacker(2, 64), 100)), ValueError,
        "dataset[0] raised KeyError: WLBStream.from_dataset reads items by index, 0 .. len(dataset) - 1 = 1")]
)


def _floor(batches=([5, 9],), n_micro=2, max_tokens=10):
    from wlb_opt.solvers.bounds import delay_floor
    return delay_floor([b if isinstance(b, np.ma.MaskedArray) else np.asarray(b) for b in batches], n_micro, max_tokens)


FLOOR_CASES = (
    [(f"delay_floor.lengths.{label}", (lambda v=v: _floor(batches=(v,), max_tokens=2**61)), ValueError, frag)
     for label, v, frag in BAD_LENGTHS]
    + _bad_counts("n_micro", lambda v: _floor(n_micro=v))
    + _bad_counts("max_tokens", lambda v: _floor(max_tokens=v))
    + [("delay_floor.piece_over_max_tokens", lambda: _floor(batches=([5], [11])), ValueError,
        "batches[1] holds a piece of 11 tokens > max_tokens=10")]
)


# ---------------------------------------------------------------- the tests
PLAIN_CASES = (SPEC_CASES + COST_CASES + DOCS_CASES + PACK_CASES + PLAN_CASES + PACKER_CASES + SHARD_CASES
               + SIM_CASES + STREAM_CASES + FLOOR_CASES)
FILE_CASES = COST_FILE_CASES + LENGTH_FILE_CASES
CLI_FILE_CASES = cli_file_cases(COST)


def _raised_by_library(excinfo) -> bool:
    """The innermost frame that raised is this library's code (not numpy, json, torch, ...)."""
    tb = excinfo.tb
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return path.startswith(LIBRARY_DIRS) or path.startswith(INSTALLED)


def _check(call, exc_type, fragment):
    with pytest.raises(Exception) as info:
        call()
    assert isinstance(info.value, exc_type), f"{type(info.value).__name__}: {info.value}"
    assert fragment in str(info.value), str(info.value)
    assert _raised_by_library(info), f"raised from {info.traceback[-1].path}: {info.value!r}"


@pytest.mark.parametrize("call, exc_type, fragment", [c[1:] for c in PLAIN_CASES], ids=[c[0] for c in PLAIN_CASES])
def test_bad_argument_raises_a_clear_error(call, exc_type, fragment):
    _check(call, exc_type, fragment)


@pytest.mark.parametrize("call, exc_type, fragment", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_bad_file_raises_a_clear_error(call, exc_type, fragment, tmp_path):
    _check(lambda: call(tmp_path), exc_type, fragment)


_TORCH_CASE_IDS = [c[0] for c in _torch_cases()] if __import__("importlib").util.find_spec("torch") else []


@pytest.mark.parametrize("case_id", _TORCH_CASE_IDS)
def test_bad_tensor_argument_raises_a_clear_error(case_id):
    case = {c[0]: c for c in _torch_cases()}[case_id]
    _check(*case[1:])


def _cli(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}, stderr: {err}"
    assert "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bad_command_line_exits_2_with_a_message(argv, fragment, capsys):
    assert fragment in _cli(argv, capsys)


@pytest.mark.parametrize("make_argv, fragment", [c[1:] for c in CLI_FILE_CASES], ids=[c[0] for c in CLI_FILE_CASES])
def test_bad_command_line_file_exits_2_with_a_message(make_argv, fragment, tmp_path, capsys):
    assert fragment in _cli(make_argv(tmp_path), capsys)


def test_bad_input_suite_has_at_least_300_cases():
    n = (len(PLAIN_CASES) + len(FILE_CASES) + len(_TORCH_CASE_IDS) + len(CLI_CASES) + len(CLI_FILE_CASES)
         + len(SUBPROCESS_CASES))
    assert n >= 300, n




