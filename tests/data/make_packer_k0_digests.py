"""Builds tests/data/packer_k0_digests.json from the packer as of commit d1cf72e (before
lookahead and the new defaults): run it from a checkout of that commit,
`PYTHONPATH=. python tests/data/make_packer_k0_digests.py > tests/data/packer_k0_digests.json`.
Each entry: plan.digest() / plan.step / sha256(arrival_step) of every plan, drain included."""
import hashlib, json, numpy as np, wlb_opt as wlb
from wlb_opt.workloads import global_batches, DEFAULT_SEED
from wlb_opt.packer import WLBPacker
cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1), wlb.HardwareSpec.preset("h100"))
W = 131072
CONFIGS = {
    "old_defaults": dict(thresholds="auto", n_queues=2, max_delay=8, release="paper", balance_tolerance=1.02, delay_budget=0.5),
    "paper_none": dict(thresholds=[32768, 73728], max_delay=None, release="paper"),
    "balance_auto": dict(thresholds="auto", n_queues=2, max_delay=8, release="balance", balance_tolerance=1.02, delay_budget=0.5),
    "group": dict(thresholds=[32768, 73728], max_delay=16, release="group", balance_tolerance=1.3),
}
out = {}
for dist in ("default", "real"):
    batches = global_batches(dist, W, 4 * W, 40, seed=DEFAULT_SEED + 5)
    for name, kw in CONFIGS.items():
        p = WLBPacker(4, int(1.25 * W), cost, **kw)
        plans = [p.pack(*b) for b in batches] + p.drain()
        digests = [pl.digest() + f"/{pl.step}/" + hashlib.sha256(pl.arrival_step.tobytes()).hexdigest()[:16]
                   for pl in plans]
        out[f"{dist}/{name}"] = dict(config=kw, digests=digests)
print(json.dumps(dict(stream=dict(window=W, n_micro=4, max_tokens=int(1.25 * W), steps=40, seed_offset=5,
                                  cost="7b (8,2,4,1) h100"), runs=out), indent=1))
