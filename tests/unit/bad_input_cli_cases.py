"""The command-line rows of the bad-input table (`tests/unit/test_bad_input.py` runs them).

`CLI_CASES`: (id, argv, stderr fragment) for `wlb_opt.cli.main(argv)` in-process, which
must return 2 with no traceback. `cli_file_cases(cost)`: the same for arguments that need a
file written first (argv made from pytest's tmp_path). `SUBPROCESS_CASES`: (argv, fragment)
run as a real `wlb-opt` process. Append a tuple to add a case.
"""
from __future__ import annotations

import json
from pathlib import Path


def _write(tmp: Path, name: str, text: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


CLI_CASES = [
    ("no_command", [], "usage: wlb-opt"),
    ("unknown_command", ["train"], "unknown command 'train'"),
    ("pack.no_source", ["pack"], "one of the arguments --lengths --dist is required"),
    ("pack.unknown_dist", ["pack", "--dist", "zipf"], "invalid choice: 'zipf'"),
    ("pack.n_micro_zero", ["pack", "--dist", "default", "--n-micro", "0"], "--n-micro: expected an integer >= 1"),
    ("pack.n_micro_word", ["pack", "--dist", "default", "--n-micro", "four"], "expected an integer >= 1, got 'four'"),
    ("pack.window_negative", ["pack", "--dist", "default", "--window", "-5"], "--window: expected an integer >= 1"),
    ("pack.max_tokens_zero", ["pack", "--dist", "default", "--max-tokens", "0"], "--max-tokens: expected an integer"),
    ("pack.seed_negative", ["pack", "--dist", "default", "--seed", "-1"], "--seed: expected an integer >= 0"),
    ("pack.time_limit_zero", ["pack", "--dist", "default", "--time-limit", "0"], "--time-limit: expected a number"),
    ("pack.time_limit_nan", ["pack", "--dist", "default", "--time-limit", "nan"], "--time-limit: expected a finite"),
    ("pack.method", ["pack", "--dist", "default", "--method", "magic"], "invalid choice: 'magic'"),
    ("pack.backend", ["pack", "--dist", "default", "--backend", "gurobi"], "invalid choice: 'gurobi'"),
    ("pack.backend_without_milp", ["pack", "--dist", "default", "--backend", "highs"], "method='wlb' takes no backend"),
    ("pack.missing_lengths", ["pack", "--lengths", "/nonexistent/l.npy"], "does not exist"),
    ("pack.field_without_jsonl", ["pack", "--dist", "default", "--field", "text"], "--field names a field of a .jsonl"),
    ("pack.model", ["pack", "--dist", "default", "--model", "13b"], "unknown ModelSpec preset '13b'"),
    ("pack.hardware", ["pack", "--dist", "default", "--hardware", "tpu"], "unknown HardwareSpec preset 'tpu'"),
    ("pack.tp_zero", ["pack", "--dist", "default", "--tp", "0"], "--tp: expected an integer >= 1"),
    ("pack.dp_word", ["pack", "--dist", "default", "--dp", "x"], "--dp: expected an integer"),
    ("pack.missing_cost", ["pack", "--dist", "default", "--cost", "/nonexistent/cost.json"], "does not exist"),
    ("pack.unknown_flag", ["pack", "--dist", "default", "--fast"], "unrecognized arguments: --fast"),
    ("bench.no_name", ["bench"], "usage: wlb-opt bench"),
    ("bench.unknown", ["bench", "table3"], "unknown benchmark 'table3'"),
    ("bench.table2_steps_zero", ["bench", "table2", "--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    ("bench.table2_exact_time", ["bench", "table2", "--exact-time-limit", "-1"], "--exact-time-limit: expected"),
    ("bench.table2_max_delay", ["bench", "table2", "--max-delay", "0"], "--max-delay: expected an integer >= 1"),
    ("bench.table2_dist", ["bench", "table2", "--dist", "nope"], "invalid choice: 'nope'"),
    ("bench.table2_model", ["bench", "table2", "--model", "nope", "--steps", "1"], "unknown ModelSpec preset"),
    ("bench.table2_missing_lengths", ["bench", "table2", "--lengths", "/nonexistent.npy", "--steps", "1"],
     "does not exist"),
    ("bench.exact_gap", ["bench", "exact", "--gap-limit", "1.5"], "--gap-limit: expected a number in [0, 1)"),
    ("bench.frontier_budget", ["bench", "frontier", "--budgets", "-1"], "--budgets must be finite numbers >= 0"),
    ("bench.frontier_budget_word", ["bench", "frontier", "--budgets", "0.1,x"], "--budgets must be comma-separated"),
    ("bench.frontier_steps_zero", ["bench", "frontier", "--steps", "0"], "--steps: expected an integer >= 1"),
    ("bench.frontier_time_limit", ["bench", "frontier", "--time-limit", "0"], "--time-limit: expected"),
    ("bench.frontier_offline_dists", ["bench", "frontier", "--offline", "--dists", "real,nope"],
     "--dists: unknown distribution(s) ['nope']"),
    ("bench.frontier_offline_budget", ["bench", "frontier", "--offline", "--budgets", "-0.1"],
     "--budgets must be finite numbers >= 0"),
    ("bench.frontier_dists_without_offline", ["bench", "frontier", "--dists", "real"], "--dists needs --offline"),
    ("bench.frontier_offline_dist", ["bench", "frontier", "--offline", "--dist", "heavy"],
     "--offline runs the distributions of --dists, not --dist (use --dists heavy)"),
    ("bench.frontier_steps_within_warmup", ["bench", "frontier", "--steps", "20"],
     "--steps (20) must be more than the 20-step warm-up"),
    ("bench.frontier_jobs_without_offline", ["bench", "frontier", "--jobs", "2"], "--jobs 2 needs --offline"),
    ("bench.frontier_jobs_zero", ["bench", "frontier", "--offline", "--jobs", "0"], "--jobs: expected an integer >= 1"),
    ("bench.exact_workers", ["bench", "exact", "--workers", "0"], "--workers: expected an integer >= 1"),
    ("bench.exact_instances", ["bench", "exact", "--instances", "-2"], "--instances: expected an integer >= 1"),
    ("bench.shard_steps", ["bench", "shard", "--steps", "0"], "--steps: expected an integer >= 1"),
    ("bench.shard_repeats", ["bench", "shard", "--repeats", "zero"], "--repeats: expected an integer"),
    ("bench.pack_speed_repeats", ["bench", "pack-speed", "--repeats", "0"], "--repeats: expected an integer >= 1"),
    ("bench.pack_speed_window", ["bench", "pack-speed", "--window", "0"], "--window: expected an integer >= 1"),
    ("bench.parity_steps", ["bench", "parity", "--steps", "-1"], "--steps: expected an integer >= 1"),
    ("bench.parity_warmup", ["bench", "parity", "--steps", "10"], "--steps (10) must be more than --warmup (20)"),
    ("bench.lookahead_warmup", ["bench", "lookahead", "--steps", "5", "--warmup", "5"],
     "--steps (5) must be more than --warmup (5)"),
    ("bench.e2e_steps", ["bench", "e2e", "--steps", "0"], "--steps: expected an integer >= 1"),
    ("bench.e2e_seed", ["bench", "e2e", "--seed", "-3"], "--seed: expected an integer >= 0"),
    ("bench.kernel_heads", ["bench", "kernel", "--heads", "0"], "--heads: expected an integer >= 1"),
    ("bench.kernel_budget", ["bench", "kernel", "--budget-s", "inf"], "--budget-s: expected a finite number"),
    ("bench.kernel_warmup", ["bench", "kernel", "--warmup", "-1"], "--warmup: expected an integer >= 0"),
    ("bench.cp_path_repeats", ["bench", "cp-path", "--repeats", "0"], "--repeats: expected an integer >= 1"),
    ("bench.cp_path_device", ["bench", "cp-path", "--device", "bogus", "--out", "/nonexistent/cp_path"],
     "device 'bogus' is not a torch device name"),
    ("bench.cp_path_head_dim_without_full", ["bench", "cp-path", "--head-dim", "64"],
     "--full-tokens and --head-dim size the --full run: give --full too"),
    ("bench.cost_check_steps_within_warmup", ["bench", "cost-check", "--measured", "m.json", "--steps", "20"],
     "--steps (20) must be more than the 20-step warm-up"),
    ("bench.kernel_smoke_sizes", ["bench", "kernel", "--cpu-smoke", "--reps", "7"],
     "--cpu-smoke sets its own sizes; drop --reps"),
    ("bench.kernel_scaling_uneven", ["bench", "kernel", "--scaling", "512", "3000"],
     "--scaling lengths must divide --scaling-tokens (32768), got [3000]"),
    ("bench.validate_sim_window", ["bench", "validate-sim", "--window", "262144"],
     "--window must be at most 131072 tokens"),
    ("bench.pipeline_replay_max_pp", ["bench", "pipeline-replay", "--max-pp", "1"], "--max-pp must be an integer >= 2"),
    ("bench.pipeline_replay_max_micro", ["bench", "pipeline-replay", "--max-micro", "1"],
     "--max-micro must be an integer >= 2"),
    ("bench.pipeline_replay_bound_draws", ["bench", "pipeline-replay", "--draws", "1", "--bound-per-draw", "2,2,1"],
     "--bound-draws 2 must be at most --draws (1)"),
    ("bench.stream_speed_steps_within_lookahead", ["bench", "stream-speed", "--steps", "3", "--lookaheads", "0,4"],
     "--steps (3) must be more than the largest of --lookaheads (4)"),
    ("bench.validate_sim_one_stage_interleaved", ["bench", "validate-sim", "--pp", "1"],
     "--virtual-stages 2 needs --pp >= 2"),
    ("bench.loss_memory_tokens", ["bench", "loss-memory", "--tokens", "0"], "--tokens: expected an integer >= 1"),
    ("bench.validate_sim_pp", ["bench", "validate-sim", "--pp", "0"], "--pp: expected an integer >= 1"),
    ("bench.validate_sim_layers", ["bench", "validate-sim", "--layers", "0"], "--layers: expected an integer >= 1"),
    ("bench.validate_sim_virtual_stages_zero", ["bench", "validate-sim", "--virtual-stages", "0"],
     "--virtual-stages must be integers >= 1, got '0'"),
    ("bench.pipeline_replay_sigma_nan", ["bench", "pipeline-replay", "--sigma", "nan"], "--sigma: expected a finite"),
    ("bench.pipeline_replay_sigma_negative", ["bench", "pipeline-replay", "--sigma", "-1"],
     "--sigma: expected a number >= 0, got '-1'"),
    ("bench.shard_cps_repeated", ["bench", "shard", "--cps", "2,2"], "--cps must not repeat a value, got '2,2'"),
    ("bench.shard_strategies_repeated", ["bench", "shard", "--strategies", "per_doc,per_doc"],
     "--strategies must not repeat a value"),
    ("bench.memory_window", ["bench", "memory", "--window", "32"], "--window must be an integer >= 64"),
    ("bench.exact_no_dists", ["bench", "exact", "--dists", ","], "--dists names no distribution"),
    ("bench.exact_no_methods", ["bench", "exact", "--methods", ",", "--exact", ","], "name no method"),
    ("bench.parity_settings", ["bench", "parity", "--settings", "bogus"],
     "error: --settings must name distinct settings among"),
    ("bench.parity_settings_misspelt", ["bench", "parity", "--settings", "default,defualt"],
     "(unknown: ['defualt'])"),
    ("bench.parity_settings_repeated", ["bench", "parity", "--settings", "default,default"],
     "error: --settings must name distinct settings"),
    ("bench.parity_seeds_repeated", ["bench", "parity", "--seeds", "0,0"], "--seeds must not repeat a seed, got '0,0'"),
    ("profile.dtype", ["profile", "--dtype", "bogus"], "dtype must be one of"),
    ("profile.window", ["profile", "--window", "0"], "--window: expected an integer >= 1"),
    ("profile.window_one_document", ["profile", "--window", "12"], "--window must be >= 16 tokens"),
    ("profile.samples", ["profile", "--samples", "-4"], "--samples: expected an integer >= 1"),
    ("profile.repeats", ["profile", "--repeats", "x"], "--repeats: expected an integer"),
    ("profile.unknown_flag", ["profile", "--gpu"], "unrecognized arguments: --gpu"),
    ("profile.q_lens_past_window", ["profile", "--q-lens", "16,64,4096", "--window", "128"],
     "--q-lens 16,64,4096 reaches past --window 128"),
    ("profile.holdout", ["profile", "--holdout", "1"], "--holdout must be >= 3"),
    ("profile.kv_len_short", ["profile", "--q-lens", "16,64", "--kv-len", "32"],
     "--kv-len 32 must be >= the longest --q-lens (64)"),
    ("demo.steps", ["demo", "--steps", "0"], "--steps: expected an integer >= 1"),
    ("demo.seed", ["demo", "--seed", "-1"], "--seed: expected an integer >= 0"),
    ("demo.configs", ["demo", "--configs", "nope"], "usage: wlb-opt demo [-h] [--out OUT]"),
]


def cli_file_cases(cost_model):
    """CLI cases that need a file written first: (id, make argv from tmp_path, fragment)."""
    cost = cost_model.to_dict()
    files = {
        "cost_not_json": ("c.json", "{oops", "is not JSON"),
        "cost_list": ("c.json", "[1, 2]", "is a JSON object"),
        "cost_unknown_key": ("c.json", json.dumps({**cost, "bogus": 1}), "unknown fields ['bogus']"),
        "cost_missing_key": ("c.json", json.dumps({k: v for k, v in cost.items() if k != "coef"}),
                             "missing fields ['coef']"),
        "cost_string_coef": ("c.json", json.dumps({**cost, "coef": {"fwd": {**cost["coef"]["fwd"], "attn": "x"},
                                                                    "bwd": cost["coef"]["bwd"]}}),
                             "must be a finite number"),
        "cost_nan_tile": ("c.json", json.dumps({**cost, "tile": 1.5}), "CostModel.tile must be an integer"),
    }
    out = [(f"pack.{name}", (lambda tmp, n=n, t=t: ["pack", "--dist", "default", "--cost", str(_write(tmp, n, t))]),
            frag) for name, (n, t, frag) in files.items()]
    lengths = {"lengths_zero": ("l.txt", "5\n0\n", "positive token counts"),
               "lengths_word": ("l.txt", "5\nfive\n", "expected one integer length per line"),
               "lengths_jsonl_true": ("l.jsonl", '{"length": true}\n', "must be an integer length or a string"),
               "lengths_jsonl_field": ("l.jsonl", '{"n": 3}\n', "no field 'length'"),
               "lengths_empty": ("l.txt", "", "no document lengths in")}
    out += [(f"pack.{name}", (lambda tmp, n=n, t=t: ["pack", "--lengths", str(_write(tmp, n, t))]), frag)
            for name, (n, t, frag) in lengths.items()]
    out += [("pack.lengths_directory", lambda tmp: ["pack", "--lengths", str(tmp)], "is not a file"),
            ("pack.lengths_too_long", lambda tmp: ["pack", "--lengths", str(_write(tmp, "l.txt", "900\n")),
                                                   "--window", "1000", "--max-tokens", "100"], "900"),
            ("bench.table2_cost", lambda tmp: ["bench", "table2", "--steps", "1", "--cost",
                                               str(_write(tmp, "c.json", "{"))], "is not JSON"),
            ("profile.hf_config_not_json", lambda tmp: ["profile", "--hf-config", str(_write(tmp, "h.json", "{x"))],
             "h.json: not a JSON config"),
            ("bench.frontier_lengths_under_a_step", lambda tmp: ["bench", "frontier", "--steps", "24", "--lengths",
                                                                 str(_write(tmp, "l.txt", "5\n7\n"))],
             "(not even one step)")]
    return out



SUBPROCESS_CASES = [
    (["bench", "table2", "--steps", "0"], "--steps: expected an integer >= 1"),
    (["profile", "--dtype", "bogus"], "dtype must be one of"),
    (["pack", "--dist", "default", "--cost", "/nonexistent/cost.json"], "does not exist"),
    (["pack", "--lengths", "/"], "is not a file"),
]
