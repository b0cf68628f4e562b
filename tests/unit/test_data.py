"""Length data (`wlb_opt.workloads`), the shared cost-model options (`wlb_opt.cost_args`), and the
bench-side stream helpers (`wlb_opt.bench.data`)."""
import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt import workloads
from wlb_opt.cost_args import add_cost_args, cost_from_args, layout_from_args


def test_core_data_module_imports_no_planner_or_benchmark():
    code = ("import sys, wlb_opt.workloads as d; d.global_batch('default', 4096, 16384); "
            "bad = [m for m in sys.modules if m.startswith(('wlb_opt.bench', 'wlb_opt.pack', 'wlb_opt.step_pack', "
            "'wlb_opt.solvers', 'wlb_opt.cli', 'wlb_opt.shard', 'wlb_opt.simulate'))]; print(bad); "
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_global_batches_cut_one_stream_into_consecutive_batches():
    window, per_batch = 8192, 4 * 8192
    batches = workloads.global_batches("default", window, per_batch, 5, seed=3)
    assert len(batches) == 5
    per_batch_ids = [set(np.unique(b[1]).tolist()) for b in batches]
    assert sum(map(len, per_batch_ids)) == len(set().union(*per_batch_ids))  # a document is in one batch only
    stream = workloads.document_stream(per_batch * 5, "default", 3)
    for pieces, piece_ids, offsets in batches:
        assert pieces.max() <= window and pieces.min() >= 1
        # every document of the batch is there, cut into pieces that add up to it
        for doc in np.unique(piece_ids):
            assert pieces[piece_ids == doc].sum() == stream[doc]
            assert offsets[piece_ids == doc][0] == 0
    # the same seed gives the same batches
    again = workloads.global_batch("default", window, per_batch, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(again, batches[0]))


def test_global_batches_of_given_lengths_take_any_sequence_and_refuse_bad_sizes():
    as_list = workloads.global_batches("default", 8, 10, 2, lengths=[5, 7, 3, 9])
    as_array = workloads.global_batches("default", 8, 10, 2, lengths=np.array([5, 7, 3, 9]))
    assert [[a.tolist() for a in b] for b in as_list] == [[a.tolist() for a in b] for b in as_array]
    # documents start at 0, 5, 12, 15 (cut to 8 tokens): two in each batch of 10 tokens
    assert [b[1].tolist() for b in as_list] == [[0, 1], [2, 3, 3]]
    empty = workloads.global_batches("default", 8, 10, 2, lengths=np.zeros(0, np.int64))
    assert [len(b[0]) for b in empty] == [0, 0]
    assert len(workloads.document_stream(0)) == 0
    with pytest.raises(ValueError, match="tokens_per_batch must be an integer >= 1, got 0"):
        workloads.global_batches("default", 8, 0, 2, lengths=[5, 7])
    with pytest.raises(ValueError, match="n_tokens must be an integer >= 0, got -1"):
        workloads.document_stream(-1)
    with pytest.raises(ValueError, match="lengths"):
        workloads.global_batches("default", 8, 10, 2, lengths=[5, 0])


def test_distributions_and_errors():
    assert set(workloads.DISTRIBUTIONS) == {"default", "light", "heavy", "real", "code", "prose"}
    assert workloads.sample_documents(100, "light", seed=1).min() >= 1
    with pytest.raises(ValueError, match="unknown length distribution"):
        workloads.sample_documents(10, "pareto")
    for kw, words in ((dict(n=-1), "n must be an integer >= 0, got -1"), (dict(n=2.5), "n must be an integer"),
                      (dict(n=3, seed=-1), "seed must be an integer >= 0, got -1"),
                      (dict(n=3, seed=1.5), "seed must be an integer >= 0, got 1.5")):
        with pytest.raises(ValueError, match=words):
            workloads.sample_documents(**kw)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -2"):
        workloads.document_stream(10, seed=-2)


def test_heavy_has_the_default_body_and_a_heavier_longer_tail():
    n = 200_000
    default, heavy = workloads.sample_documents(n, "default", seed=5), workloads.sample_documents(n, "heavy", seed=5)
    # the same body: the medians agree (the tail holds well under 1% of documents)
    assert abs(np.median(heavy) / np.median(default) - 1) < 0.05
    # twice the tail probability, spanning [32768, 524288] (documents up to four windows)
    assert 0.0025 < np.mean(heavy >= 32768) < 0.0035 and heavy.max() <= 524288 and heavy.max() > 163840
    share = lambda x: x[x >= 32768].sum() / x.sum()
    assert share(heavy) > 2 * share(default)


def test_real_distribution_reads_the_file_shipped_inside_the_package():
    assert workloads.REAL_FILE.parent.name == "wlb_opt" and workloads.REAL_FILE.exists()
    real = workloads.real_lengths()
    assert real.dtype == np.int64 and len(real) > 1000
    assert set(workloads.sample_documents(200, "real", seed=0)) <= set(real.tolist())


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_cost_args(p, **kw)
    return p


def test_cost_args_build_the_cost_model_for_the_layout_packed():
    p = _parser()
    args = p.parse_args(["--model", "tiny", "--dp", "2"])
    cost = cost_from_args(args)
    assert cost.parallel == wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=2) and cost.model == wlb.ModelSpec.preset("tiny")
    one = cost_from_args(args, dp=1)
    assert one.parallel.dp == 1 and one.coef == cost.coef  # dp does not change the coefficients
    assert layout_from_args(args, cp=4).cp == 4
    with pytest.raises(ValueError, match="unknown layout degrees"):
        cost_from_args(args, ep=2)


def test_cost_args_can_hide_layout_degrees():
    p = _parser(layout=("tp",))
    with pytest.raises(SystemExit):
        p.parse_args(["--dp", "2"])
    args = p.parse_args([])
    assert (args.tp, args.cp, args.pp, args.dp) == (8, 2, 4, 1)


def test_saved_cost_keeps_its_tp_and_cp_and_takes_the_commands_dp_and_pp(tmp_path):
    saved = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(tp=2, cp=4, pp=2, dp=1))
    saved.save(tmp_path / "c.json")
    args = _parser().parse_args(["--cost", str(tmp_path / "c.json"), "--dp", "3", "--pp", "5"])
    cost = cost_from_args(args)
    assert (cost.parallel.tp, cost.parallel.cp, cost.parallel.pp, cost.parallel.dp) == (2, 4, 5, 3)
    assert cost.coef == saved.coef
    assert cost_from_args(args, cp=4).parallel.cp == 4
    with pytest.raises(ValueError, match="disagrees"):
        cost_from_args(args, cp=2)
    # a model without a layout comes back as it is
    saved.without_layout().save(tmp_path / "free.json")
    free = cost_from_args(_parser().parse_args(["--cost", str(tmp_path / "free.json")]))
    assert free.parallel is None


def test_cost_args_report_bad_options_through_the_parser(tmp_path, capsys):
    p = _parser()
    with pytest.raises(SystemExit) as exc:
        cost_from_args(p.parse_args(["--model", "13b"]), parser=p)
    assert exc.value.code == 2 and "ModelSpec preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cost_from_args(p.parse_args(["--cost", str(tmp_path / "missing.json")]), parser=p)
    with pytest.raises(ValueError):
        cost_from_args(p.parse_args(["--hardware", "tpu"]))


def test_carried_plans_place_every_token_once():
    from wlb_opt.bench.data import carried_plans

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(pp=2))
    batches = workloads.global_batches("default", 4096, 2 * 4096, 6, seed=1)
    plans = [plan for plan, seconds in carried_plans(batches, 2, 4096, cost, "original", pool=2)]
    assert len(plans) == 3
    placed = sum(p.placed_tokens for p in plans) + plans[-1].deferred_tokens
    assert placed == sum(int(b[0].sum()) for b in batches)


def test_run_packer_streams_then_drains():
    from wlb_opt.bench.data import run_packer

    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), wlb.ParallelSpec(pp=2))
    batches = workloads.global_batches("default", 4096, 2 * 4096, 5, seed=2)
    run = run_packer(wlb.WLBPacker(2, 5120, cost, config=wlb.PackerConfig(thresholds=[2048], max_delay=4)), batches)
    assert len(run.plans) == len(run.seconds) == 5
    total = sum(p.placed_tokens for p in run.plans + run.drained)
    assert total == sum(int(b[0].sum()) for b in batches)
    assert run.stats["steps"] == run.streamed_stats["steps"] + len(run.drained)
    json.dumps(run.stats, default=str)


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_code_and_prose_distributions_read_the_files_shipped_in_bench(kind):
    path = workloads.kind_file(kind)
    assert path.parent.name == "bench" and path.exists()
    lengths = workloads.kind_lengths(kind)
    assert lengths.dtype == np.int64 and len(lengths) > 1000 and lengths.min() >= 16
    assert set(workloads.sample_documents(200, kind, seed=0)) <= set(lengths.tolist())
    with pytest.raises(ValueError, match="kind must be one of"):
        workloads.kind_file("poetry")


def test_code_and_prose_differ_in_shape():
    code, prose = workloads.kind_lengths("code"), workloads.kind_lengths("prose")
    # prose: shorter typical file, heavier tail (more of its files are outliers)
    assert np.median(prose) < 0.6 * np.median(code)
    assert np.mean(prose >= 32768) > 2 * np.mean(code >= 32768)
