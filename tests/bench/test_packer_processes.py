"""The packer in separate processes: the table2 benchmark on a small stream, and two processes with
one seed agreeing."""

import json
import subprocess
import sys


def test_two_processes_with_the_same_seed_agree():
    code = (
        "import numpy as np, wlb_opt as wlb\n"
        "from wlb_opt.workloads import global_batches\n"
        "cost = wlb.CostModel.analytic(wlb.ModelSpec.preset('7b'), wlb.ParallelSpec(tp=8, cp=2, pp=4), "
        "wlb.HardwareSpec.preset('h100'))\n"
        "p = wlb.WLBPacker(4, 163840, cost, thresholds='auto', seed=5)\n"
        "ds = [p.pack(l, i, o).digest() for l, i, o in global_batches('default', 131072, 4 * 131072, 12)]\n"
        "print(','.join(ds + [d.digest() for d in p.drain()]), p.thresholds)\n")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) > 64 * 12


def test_table2_bench_runs_small(tmp_path, capsys):
    from wlb_opt.bench import table2

    rc = table2.main(["--steps", "3", "--exact-steps", "1", "--exact-time-limit", "0.5", "--no-progress",
                      "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "table2.json").read_text())
    names = [r["row"] for r in data["rows"]]
    assert names[:2] == ["original", "fixed greedy k=1"] and "WLB 2 queues" in names and "WLB auto" in names
    assert all(r.get("pending") or r["imbalance"] >= 1.0 for r in data["rows"])
    assert "paper imb" in capsys.readouterr().out


def test_table2_of_a_lengths_file_calibrates_on_batches_it_does_not_score(tmp_path, monkeypatch):
    import numpy as np

    from wlb_opt.bench import table2
    from wlb_opt.packer import WLBPacker

    window, n_micro = 4096, 2
    lengths = np.random.default_rng(0).permutation(np.arange(1000, 3400))  # every length once: a document by its length
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths.tolist())))
    seen = {}
    calibrate = WLBPacker.calibrate

    def recorded(self, sample, *args, **kwargs):
        seen.setdefault("sample", set(np.asarray(sample).tolist()))
        return calibrate(self, sample, *args, **kwargs)

    monkeypatch.setattr(WLBPacker, "calibrate", recorded)
    steps = 6
    assert table2.main(["--lengths", str(path), "--steps", str(steps), "--window", str(window), "--n-micro",
                        str(n_micro), "--exact-steps", "0", "--no-progress", "--out", str(tmp_path)]) == 0
    per_batch = n_micro * window
    scored = set(lengths[np.cumsum(lengths) - lengths < steps * per_batch].tolist())
    assert seen["sample"] and not seen["sample"] & scored
