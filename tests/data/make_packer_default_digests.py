"""Builds tests/data/packer_default_digests.json: the plans of the no-tuning defaults
(`WLBPacker(4, int(1.25 * W), cost)` with no policy but the lookahead given) at lookahead 0, 2 and 4, with
the default step packer and with Algorithm 1 (`method="wlb"`), on the streams of
make_packer_k0_digests.py (same cost, window, batches). Run it from the
repository root: `PYTHONPATH=. python tests/data/make_packer_default_digests.py >
tests/data/packer_default_digests.json`. Each entry: plan.digest() / plan.step /
sha256(arrival_step) of every plan, drain included."""
import hashlib
import json

import wlb_opt as wlb
from wlb_opt.workloads import DEFAULT_SEED, global_batches
from wlb_opt.packer import PackerConfig, WLBPacker

cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                              wlb.HardwareSpec.preset("h100"))
W = 131072
# the default step packer, and Algorithm 1 (the release's decisions are the same, made on
# Algorithm 1's packings; its plans are those recorded before the default packed the phases apart)
METHODS = ("wlb_phases", "wlb")
LOOKAHEADS = (0, 2, 4)
out = {}
for dist in ("default", "real"):
    batches = global_batches(dist, W, 4 * W, 40, seed=DEFAULT_SEED + 5)
    for k in LOOKAHEADS:
        for method in METHODS:
            p = WLBPacker(4, int(1.25 * W), cost, config=PackerConfig(lookahead=k, method=method))
            plans = [p.pack(*b) for b in batches] + p.drain()
            digests = [pl.digest() + f"/{pl.step}/" + hashlib.sha256(pl.arrival_step.tobytes()).hexdigest()[:16]
                       for pl in plans if pl is not None]
            out[f"{dist}/lookahead{k}/{method}"] = dict(lookahead=k, method=method, digests=digests)
print(json.dumps(dict(stream=dict(window=W, n_micro=4, max_tokens=int(1.25 * W), steps=40, seed_offset=5,
                                  cost="7b (8,2,4,1) h100"), runs=out), indent=1))
