"""`wlb-opt bench e2e` and `wlb-opt demo` on tiny configurations: the JSON rows, the PNGs, the
configuration parser, and that the methods are simulated on the plans they claim."""
import importlib.util
import json

import numpy as np
import pytest

import wlb_opt as wlb
from wlb_opt.bench import demo, e2e

REQUIRED = {"model", "context", "method", "step_time_s", "tokens_per_s", "speedup_vs_plain", "imbalance_pp",
            "imbalance_cp"}


def test_e2e_command_on_a_tiny_configuration_writes_rows_and_pngs(tmp_path):
    rc = e2e.main(["--quick", "--configs", "TINY-4K@1,2,2,1", "--steps", "3", "--out", str(tmp_path),
                   "--no-progress"])
    assert rc == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())
    assert isinstance(rows, list) and len(rows) == 4
    assert [r["method"] for r in rows] == ["plain", "fixed", "wlb", "best"]
    for r in rows:
        assert REQUIRED <= set(r)
        assert r["model"] == "tiny" and r["context"] == 4096
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["imbalance_pp"] >= 1.0 and r["imbalance_cp"] >= 1.0
    assert rows[0]["speedup_vs_plain"] == pytest.approx(1.0)
    for r in rows[1:]:
        assert r["speedup_vs_plain"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"])
    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra draws the pictures
        assert (tmp_path / "speedup.png").stat().st_size > 1000
        assert (tmp_path / "gantt_tiny_4k.png").stat().st_size > 1000
    meta = json.loads((tmp_path / "e2e_meta.json").read_text())
    assert meta["paper"]["b7_128k"] == 1.33 and meta["steps"] == 3


def test_run_config_simulates_the_plans_it_reports():
    cfg = e2e.Config("tiny", 4096, 1, 2, 2, 2)
    batches = e2e.make_batches(cfg, 3, "default", 0)
    rows, detail = e2e.run_config(cfg, batches, methods=("plain", "wlb"))
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), cfg.parallel, wlb.HardwareSpec.preset("h100"))
    plans, results = detail["plain"]
    assert len(plans) == len(results) == 3
    for plan, res in zip(plans, results):
        wlb.check_pack(plan, plan.lengths, cfg.context, ids=plan.doc_ids, offsets=plan.offsets)
        assert res.tokens == plan.placed_tokens
        assert len(res.pipelines) == cfg.dp
    # throughput is tokens over simulated seconds of every step, drain steps included
    wplans, wres = detail["wlb"]
    row = next(r for r in rows if r["method"] == "wlb")
    assert row["steps"] == len(wres) >= 3
    assert row["tokens_per_s"] == pytest.approx(sum(r.tokens for r in wres) / sum(r.step_time_s for r in wres))
    # every document of the stream is trained on exactly once by the end (queues drained)
    stream_tokens = sum(int(b[0].sum()) for b in batches)
    assert sum(r.tokens for r in wres) == stream_tokens
    assert all(p.max_tokens == int(1.25 * cfg.context) for p in wplans)
    assert cost.micro_batch_cost([]) > 0


def test_parse_configs():
    assert e2e.parse_configs(None) == e2e.CONFIGS
    assert len(e2e.CONFIGS) == 8
    assert e2e.parse_configs("7b-128k") == (e2e.Config("7b", 131072, 8, 2, 4, 1),)
    got = e2e.parse_configs("TINY-4K@1,2,2,1,7B-64K")
    assert got == (e2e.Config("tiny", 4096, 1, 2, 2, 1), e2e.Config("7b", 65536, 4, 2, 4, 1))
    with pytest.raises(ValueError, match="unknown configuration"):
        e2e.parse_configs("9B-1K")
    with pytest.raises(ValueError, match="ModelSpec preset"):
        e2e.parse_configs("NOPE-4K@1,1,1,1")


def test_make_batches_from_a_length_file_covers_the_requested_tokens():
    cfg = e2e.Config("tiny", 4096, 1, 1, 2, 1)
    lengths = np.array([100, 3000, 9000, 50])
    batches = e2e.make_batches(cfg, 4, "default", 0, lengths)
    assert len(batches) == 4
    for pieces, ids, offsets in batches:
        assert pieces.max() <= cfg.context
        assert pieces.sum() >= cfg.pp * cfg.context * 0.5


def test_demo_runs_quick_e2e_and_names_the_pngs(tmp_path, capsys):
    rc = demo.main(["--configs", "TINY-4K@1,2,2,1", "--steps", "2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "speedup" in out and str(tmp_path / "speedup.png") in out
    assert (tmp_path / "e2e.json").exists()


def _deal_by_mutation(plan, shards, cfg, cost):
    """The old in-place DP refinement loop (first improving swap in (a, b) order), on a copy."""
    replica_of = np.array(plan.replica_of)

    def step(r):
        return wlb.simulate_step(plan.replace(replica_of=r.copy()), shards, cost, cfg.parallel).step_time_s

    best, improved = step(replica_of), True
    while improved:
        improved = False
        for a in range(len(replica_of)):
            for b in range(a + 1, len(replica_of)):
                if replica_of[a] == replica_of[b]:
                    continue
                replica_of[[a, b]] = replica_of[[b, a]]
                t = step(replica_of)
                if t < best - 1e-12:
                    best, improved = t, True
                else:
                    replica_of[[a, b]] = replica_of[[b, a]]
    return replica_of


def test_dp_refinement_matches_the_old_loop_and_leaves_the_plan_alone():
    cfg = e2e.Config("tiny", 4096, 1, 2, 2, 2)
    cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("tiny"), cfg.parallel, wlb.HardwareSpec.preset("h100"))
    plans = e2e._fixed_length_plans(e2e.make_batches(cfg, 4, "default", 5), cfg, cost, "original")
    for plan in plans:
        shards = e2e._shards(plan, cfg, cost, ("per_seq",))
        before = plan.replica_of.copy()
        new = e2e._deal_by_simulation(plan, shards, cfg, cost)
        assert np.array_equal(plan.replica_of, before)  # plans are values: the input is not touched
        assert np.array_equal(new.replica_of, _deal_by_mutation(plan, shards, cfg, cost))
        assert np.bincount(new.replica_of, minlength=cfg.dp).tolist() == [cfg.pp] * cfg.dp


def test_gantt_shows_one_representative_step_at_equal_tokens():
    cfg = e2e.Config("tiny", 4096, 1, 2, 2, 1)
    rows, detail = e2e.run_config(cfg, e2e.make_batches(cfg, 6, "default", 0), methods=("plain", "wlb"))
    tokens = cfg.dp * cfg.pp * cfg.context
    panels = e2e._gantt_panels(detail, tokens)
    assert [label.split(",")[0] for label, _ in panels] == ["Plain-4D", "WLB-LLM"]
    k = e2e.gantt_step(detail, tokens)
    assert panels[0][1] is detail["plain"][1][k] and panels[1][1] is detail["wlb"][1][k]  # the same step
    wlb_steps = detail["wlb"][1][:6]
    close = [i for i, r in enumerate(wlb_steps) if abs(r.tokens - tokens) <= 0.10 * tokens]
    if close:
        assert k in close

    def deviation(i):
        return sum(abs(detail[m][1][i].tokens / detail[m][1][i].step_time_s
                       / (sum(r.tokens for r in detail[m][1]) / sum(r.step_time_s for r in detail[m][1])) - 1)
                   for m in ("plain", "wlb"))

    assert all(deviation(k) <= deviation(i) for i in (close or [k]))


def test_the_paper_comparison_of_a_subset_counts_what_ran_and_leaves_out_what_did_not():
    rows = [dict(config="7B-64K", context=65536, method=m, speedup_vs_plain=s)
            for m, s in (("plain", 1.0), ("fixed", 0.9), ("wlb", 1.2), ("best", 1.22))]
    lines = e2e.paper_comparison(rows)
    assert lines[0].startswith("wlb over plain, average of 1: ours 1.20x")
    assert lines[1].strip() == "64K: ours 1.20x (paper 1.15x)"
    assert len(lines) == 2 and not any("nan" in line for line in lines)
