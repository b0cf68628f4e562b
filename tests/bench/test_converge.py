"""The convergence benchmark: corpus reader, orderings, summary, and a tiny end-to-end run.

The end-to-end test trains every ordering in a tiny setting (window 64, one block of width 32,
16 steps, 2 seeds, about 20 s on 2 cores) and checks that each trains (the loss falls), that
every ordering starts from the same weights, and that the JSON and the PNG are written. It
asserts nothing about which ordering wins: that is what the benchmark measures.
"""
import json

import numpy as np
import pytest

pytest.importorskip("torch")

import wlb_opt as wlb  # noqa: E402
from wlb_opt.bench import _converge_plans as plans  # noqa: E402
from wlb_opt.bench import converge  # noqa: E402
from wlb_opt.bench._converge_train import ConvergeConfig  # noqa: E402
from wlb_opt.bench.corpus import heldout_by_path, read_corpus, stdlib_root  # noqa: E402


def _write_corpus(root, n=60, seed=0):
    """n text files of log-uniform sizes (64 B .. 40 KB), line-structured."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        size = int(np.exp(rng.uniform(np.log(64), np.log(40000))))
        line = f"def f_{i}(x):\n    return x + {i}\n".encode()
        folder = root / f"pkg{i % 3}"
        folder.mkdir(exist_ok=True)
        (folder / f"m{i}.py").write_bytes((line * (size // len(line) + 1))[:size])
    (root / "binary.py").write_bytes(b"\x00" * 500)  # not text: skipped
    (root / "tiny.py").write_bytes(b"x = 1\n")  # under min_bytes: skipped
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "cached.py").write_bytes(b"y = 2\n" * 50)  # excluded folder


def test_corpus_lengths_split_and_slices(tmp_path):
    _write_corpus(tmp_path)
    c = read_corpus(tmp_path, window=128)
    assert len(c.paths) == 60 and "binary.py" not in c.paths and not any("__pycache__" in p for p in c.paths)
    sizes = np.array([len(b) for b in c.contents])
    order = np.argsort(sizes, kind="stable")
    assert np.all(np.diff(c.lengths[order]) >= 0)  # the map keeps the order of sizes
    assert c.lengths.min() >= 16 and np.all(c.lengths <= sizes)
    assert c.lengths.max() >= 128  # the largest files still exceed the window (the tail)
    # the split is a function of the relative path alone
    assert [heldout_by_path(p, 100) for p in c.paths] == c.heldout.tolist()
    assert read_corpus(tmp_path, window=128).heldout.tolist() == c.heldout.tolist()
    for f in range(len(c.paths)):
        first, later = c.document(f, 0), c.document(f, 3)
        assert first == c.contents[f][:c.lengths[f]]
        assert len(later) == c.lengths[f] and later in c.contents[f]
    assert any(c.document(f, 0) != c.document(f, 1) for f in range(len(c.paths)))
    s = c.stats()
    share = c.lengths[c.lengths < 64].sum() / c.lengths.sum()
    assert s["short_token_share"] == pytest.approx(share)
    assert s["train_files"] + s["heldout_files"] == 60


def test_corpus_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        read_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="no text files"):
        read_corpus(tmp_path)
    _write_corpus(tmp_path, n=5)
    for kwargs, word in ((dict(window=1), "window"), (dict(exponent=0), "exponent"),
                         (dict(heldout_per_mille=1000), "heldout_per_mille"), (dict(ref_quantile=2), "ref_quantile")):
        with pytest.raises(ValueError, match=word):
            read_corpus(tmp_path, **kwargs)


def test_stdlib_corpus_has_a_long_tail():
    c = read_corpus(window=512)
    assert c.root == stdlib_root()
    s = c.stats()
    assert s["train_files"] > 100 and s["heldout_files"] > 10
    assert 0.5 < s["short_token_share"] < 0.95 and s["documents_at_least_window"] >= 1


def _batches(seed=0, window=64, n_micro=2, steps=16, fill=0.9):
    lengths = np.random.default_rng(seed).lognormal(np.log(12), 1.0, 4000).astype(np.int64) + 2
    lengths[::37] = window + 20  # outliers longer than the window (cut into pieces)
    return plans.stream_batches(lengths, window, int(fill * n_micro * window), steps)


@pytest.mark.parametrize("ordering", plans.ORDERINGS)
def test_orderings_train_every_token_once(ordering):
    cost = ConvergeConfig(window=64, n_micro=2, steps=16, dim=32, layers=1, heads=2, kv_heads=1, ffn=64).cost()
    batches = _batches()
    steps, facts = plans.ordering_steps(ordering, batches, 2, 64, cost)
    plans.check_every_token_once(steps, batches)
    capacity = 2 * (1.25 * 64 if ordering == "wlb" else 64)  # tokens one step can place
    total = sum(int(np.sum(b[0])) for b in batches)
    assert len(steps) >= total / capacity and all(len(p.micro_batches) == 2 for p in steps)
    moved = plans.displacement(steps, plans.arrival_batches(batches))
    limit = 1.25 * 64 if ordering == "wlb" else 64
    assert all(int(p.lengths[mb].sum()) <= limit for p in steps for mb in p.micro_batches)
    if ordering == "wlb":  # computed from the batches here, by the packer's own accounting there
        assert moved["delay_per_token"] == pytest.approx(facts["packer_delay_per_token"])
    if ordering == "fixed-8":  # a piece moves inside its pool of 8 batches, or is carried later
        assert moved["displacement_per_token"] > 0.5 and moved["delay_per_token"] >= -3.5
    # a step dropped or repeated is caught
    with pytest.raises(RuntimeError):
        plans.check_every_token_once(steps[1:], batches)
    with pytest.raises(RuntimeError):
        plans.check_every_token_once(steps + steps[:1], batches)


def test_single_moves_nothing_when_each_batch_fits():
    batches = _batches(fill=0.6)
    steps, _ = plans.ordering_steps("single", batches, 2, 64, None)
    assert len(steps) == len(batches)
    assert plans.displacement(steps, plans.arrival_batches(batches))["displacement_per_token"] == 0


def test_split_steps_keeps_bin_order():
    plan = wlb.solve_pack([5, 6, 7, 8, 9, 10], 6, 10, None, "fixed")
    parts = plans.split_steps(plan, 2)
    # the same pieces, micro-batch for micro-batch in bin order, each step a plan of its own pieces alone
    assert [p.doc_ids[mb].tolist() for p in parts for mb in p.micro_batches] == \
        [plan.doc_ids[mb].tolist() for mb in plan.micro_batches]
    assert [p.lengths[mb].tolist() for p in parts for mb in p.micro_batches] == \
        [plan.lengths[mb].tolist() for mb in plan.micro_batches]
    for p in parts:
        assert wlb.PackPlan.from_dict(p.to_dict()).digest() == p.digest()  # loads: no piece left out
    with pytest.raises(ValueError, match="does not split"):
        plans.split_steps(plan, 4)


def _row(ordering, seed, train, held):
    return dict(ordering=ordering, seed=seed, train_loss=train, heldout_loss=held, heldout_steps=[0, 2],
                final_heldout=held[-1],
                displacement_per_token=0.0, delay_per_token=0.0, moved_token_share=0.0, imbalance=1.0,
                imbalance_p90=1.0, tokens_per_step_cv=0.0, steps=len(train))


def test_summary_is_paired_by_seed():
    rows = [_row("single", 0, [2.0, 2.0], [5.0, 1.0]), _row("single", 1, [4.0, 4.0], [5.0, 2.0]),
            _row("wlb", 0, [2.2, 2.2, 9.0], [5.0, 1.1]), _row("wlb", 1, [4.0, 4.0], [5.0, 2.0])]
    s = {r["ordering"]: r for r in converge.summarize(rows, steps=2)}
    assert s["single"]["mean_train_loss_rel"] == 0 and s["single"]["final_heldout_rel"] == 0
    assert s["wlb"]["mean_train_loss_rel"] == pytest.approx(0.05)  # (0.1 + 0) / 2; step 3 is past `steps`
    assert s["wlb"]["mean_train_loss_rel_std"] == pytest.approx(np.std([0.1, 0.0], ddof=1))
    assert s["wlb"]["final_heldout_rel"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="single"):
        converge.summarize(rows[2:], steps=2)
    rows[2] = _row("wlb", 0, [2.0, 2.0], [5.5, 1.0])
    with pytest.raises(RuntimeError, match="different held-out"):
        converge.summarize(rows, steps=2)


def test_config_and_cli_reject_bad_input(tmp_path):
    with pytest.raises(ValueError, match="multiple of 8"):
        ConvergeConfig(steps=12)
    with pytest.raises(ValueError, match="fill"):
        ConvergeConfig(fill=1.5)
    with pytest.raises(SystemExit):
        converge.main(["--out", str(tmp_path), "--orderings", "wlb,fixed-8"])  # no single
    with pytest.raises(SystemExit):
        converge.main(["--out", str(tmp_path), "--orderings", "single,shuffled"])


def test_tiny_run_trains_every_ordering_and_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "converge"
    assert converge.main(["--steps", "16", "--seeds", "2", "--window", "64", "--n-micro", "2", "--layers", "1",
                          "--dim", "32", "--eval-every", "8", "--workers", "1", "--out", str(out)]) == 0
    assert "held-out vs single" in capsys.readouterr().out
    data = json.loads((out / "converge.json").read_text())
    assert (out / "converge.png").stat().st_size > 10_000
    runs = data["runs"]
    assert sorted((r["ordering"], r["seed"]) for r in runs) == sorted((o, s) for o in plans.ORDERINGS for s in (0, 1))
    for r in runs:
        assert len(r["train_loss"]) == r["steps"] >= 16 and len(r["heldout_loss"]) == len(r["heldout_steps"])
        assert np.mean(r["train_loss"][-4:]) < r["train_loss"][0] - 0.3  # it trains
        assert r["heldout_loss"][-1] < r["heldout_loss"][0] - 0.3
        assert r["heldout_steps"][-8:] == list(range(r["steps"] - 7, r["steps"] + 1))  # the last 8 steps
        assert r["final_heldout"] == pytest.approx(np.mean(r["heldout_loss"][-8:]))
        assert sum(r["targets_per_step"]) > 0 and r["imbalance"] >= 1.0
    for seed in (0, 1):  # every ordering of a seed starts from the same weights
        assert len({r["heldout_loss"][0] for r in runs if r["seed"] == seed}) == 1
    summary = {r["ordering"]: r for r in data["summary"]}
    assert set(summary) == set(plans.ORDERINGS)
    for r in summary.values():
        for key in ("mean_train_loss_rel", "mean_train_loss_rel_std", "final_heldout_rel", "final_heldout_rel_std"):
            assert np.isfinite(r[key])
    assert data["meta"]["corpus"]["short_token_share"] > 0.5
