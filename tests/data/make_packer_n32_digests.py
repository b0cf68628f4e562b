"""Builds tests/data/packer_n32_digests.json: the plans of the no-tuning defaults at
production scale (`WLBPacker(32, int(1.25 * W), cost)`, lookahead 0 and 4; the default step
packer and Algorithm 1, `method="wlb"`) on short `real` and `heavy` streams, so that a faster planner is held to the same plans where it works
hardest (many candidate groups per step, overloaded steps); "wlb_phases" packs the candidates of
such a step with its short pieces in lumps (packer/trial.py), keeps a plan whose short tail it
places in lumps too (solvers/phases.py, `tail_lumps`), and tries a sparse set of groups
(release.py, `sparse_window`), "wlb" every group, piece by piece. Section "capped": a
longer `heavy` stream with lookahead 4, whose slow steps reach the default step packer's
limit on candidates packed per search (release.py, `MAX_PACKED`). Run it from
the repository root:
`PYTHONPATH=. python tests/data/make_packer_n32_digests.py > tests/data/packer_n32_digests.json`.
Each entry: plan.digest() / plan.step / sha256(arrival_step) of every plan, drain included."""
import hashlib
import json

import wlb_opt as wlb
from wlb_opt.packer import PackerConfig, WLBPacker
from wlb_opt.workloads import DEFAULT_SEED, global_batches

cost = wlb.CostModel.analytic(wlb.ModelSpec.preset("7b"), wlb.ParallelSpec(tp=8, cp=2, pp=4, dp=1),
                              wlb.HardwareSpec.preset("h100"))
W = 131072
# the default step packer, and Algorithm 1 (the release's decisions are the same, made on
# Algorithm 1's packings; its plans are those recorded before the default packed the phases apart)
METHODS = ("wlb_phases", "wlb")
N_MICRO = 32
STEPS = 12
out = {}
for dist in ("real", "heavy"):
    batches = global_batches(dist, W, N_MICRO * W, STEPS, seed=DEFAULT_SEED + 9)
    for k in (0, 4):
        for method in METHODS:
            p = WLBPacker(N_MICRO, int(1.25 * W), cost, config=PackerConfig(lookahead=k, method=method))
            plans = [p.pack(*b) for b in batches] + p.drain()
            digests = [pl.digest() + f"/{pl.step}/" + hashlib.sha256(pl.arrival_step.tobytes()).hexdigest()[:16]
                       for pl in plans if pl is not None]
            out[f"{dist}/lookahead{k}/{method}"] = dict(lookahead=k, method=method, digests=digests)
CAPPED_STEPS, CAPPED_SEED_OFFSET = 40, 5
capped = {}
batches = global_batches("heavy", W, N_MICRO * W, CAPPED_STEPS, seed=DEFAULT_SEED + CAPPED_SEED_OFFSET)
p = WLBPacker(N_MICRO, int(1.25 * W), cost, config=PackerConfig(lookahead=4))
plans = [p.pack(*b) for b in batches] + p.drain()
capped["heavy/lookahead4/wlb_phases"] = dict(
    lookahead=4, method="wlb_phases",
    digests=[pl.digest() + f"/{pl.step}/" + hashlib.sha256(pl.arrival_step.tobytes()).hexdigest()[:16]
             for pl in plans if pl is not None])
print(json.dumps(dict(stream=dict(window=W, n_micro=N_MICRO, max_tokens=int(1.25 * W), steps=STEPS, seed_offset=9,
                                  cost="7b (8,2,4,1) h100"), runs=out,
                      capped=dict(stream=dict(window=W, n_micro=N_MICRO, max_tokens=int(1.25 * W), steps=CAPPED_STEPS,
                                              seed_offset=CAPPED_SEED_OFFSET, cost="7b (8,2,4,1) h100"),
                                  runs=capped)), indent=1))
