"""`wlb-opt bench report`: renders docs/results.md from the benchmarks' committed JSON.

    wlb-opt bench report            writes docs/results.md from docs/results/*/*.json
    wlb-opt bench report --check    exits 1 when docs/results.md is not what the JSON gives

Run from the repository root. Each benchmark writes its JSON (with its command line and the
machine under "provenance", see `bench._provenance`) into a folder named with `--out`;
docs/results/<benchmark>/ holds the small summaries that the documentation shows. This
command only reads them: regenerating docs/results.md runs no benchmark, and a figure reaches
the documentation only with the command that produced it. PNGs in the same folder are linked.

A table is a list of JSON objects: its columns are the keys whose values are numbers, strings
or booleans (nested values are left to the JSON). `SECTIONS` names, per benchmark, which
lists to show and which columns; a folder that `SECTIONS` does not name gets every top-level
list of objects.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path("docs/results")
"""Folder of the committed summaries, one subfolder per benchmark (relative to the repository root)."""
OUTPUT = Path("docs/results.md")
"""The generated page."""
MAX_ROWS = 80
"""Rows shown per table; the rest stay in the JSON (the page says how many were left out)."""


@dataclass(frozen=True, slots=True)
class Table:
    """One table of a section: the list at `path` inside the JSON file `file`."""

    file: str
    """JSON file inside the benchmark's folder."""
    path: tuple[str, ...] = ()
    """Keys from the file's top level down to the list (empty: the file is the list)."""
    columns: tuple[str, ...] | None = None
    """Columns in order; None: every scalar key of the first row."""
    caption: str = ""
    """One line above the table."""


@dataclass(frozen=True, slots=True)
class Section:
    """A benchmark's part of the page."""

    folder: str
    """Subfolder of `RESULTS`."""
    title: str
    """Heading."""
    what: str
    """One sentence: what the benchmark measures."""
    tables: tuple[Table, ...] = field(default_factory=tuple)
    """Tables in order; empty: every top-level list of objects of every JSON file."""
    meta_file: str | None = None
    """File whose "provenance" key names the command and machine (default: the first table's file)."""
    images: str = "*.png"
    """Glob of the folder's PNGs the section links."""
    provenance: tuple[str, ...] = ("provenance",)
    """Keys from the meta file's top level down to its provenance."""


_ON_THE_DEVICE = ("Run by scripts/gpu_check.sh on the GPU machine: the command's output folder is one on that machine, "
                  "whose JSON is this section's folder.")


def _lookahead_tables(first_caption: str) -> tuple[Table, ...]:
    """`bench lookahead`'s tables, the first captioned `first_caption`."""
    return (Table("lookahead.json", ("equal_displacement",), caption=first_caption),
            Table("lookahead.json", ("within",), caption="The lowest imbalance of each K within each displacement "
                  "limit."),
            Table("lookahead.json", ("points",), caption="Means over the seeds.",
                  columns=("dist", "lookahead", "delay_budget", "imbalance", "delay_per_token", "sim",
                           "ms_per_batch")))


_STREAM_SPEED_TABLES = (
    Table("stream_speed.json", ("rows",), caption="Per step, over every step of every seed.",
          columns=("n_micro", "dp", "dist", "method", "lookahead", "loop", "steps", "seeds", "repeats", "median_ms",
                   "p99_ms", "worst_ms", "mean_ms", "median_vs_k0", "median_of_runs_ms")),
    Table("stream_speed.json", ("shard",),
          caption="CP sharding of all micro-batches of a step: `solve_shards` (at once) and `solve_shard` (one "
                  "micro-batch at a time; the same ShardPlans)."),
    Table("stream_speed.json", ("reference",),
          caption="The machine's speed in the same run: least CPU ms of a fixed workload (`bench.stream_speed."
                  "reference_ms`), before and after the streams. Compare runs by their times over this."))
"""`bench stream-speed`'s tables (the quick run and the long one)."""


SECTIONS = (
    Section("e2e", "End-to-end step time (simulated)",
            "Simulated step time of paper Table 1's eight configurations under four packing methods "
            "(`wlb_opt.simulate`, the analytic cost model).",
            (Table("e2e_meta.json", ("rows",), caption="One row per configuration and method.",
                   columns=("config", "tp", "cp", "pp", "dp", "method", "step_time_s", "tokens_per_s", "imbalance_pp",
                            "imbalance_cp", "bubble_fraction", "speedup_vs_plain", "delay_per_token",
                            "cp_strategy")),),
            meta_file="e2e_meta.json"),
    Section("table2", "Packing balance and overhead (paper Table 2)",
            "PP imbalance and displacement of the packers on one stream at 7B-128K: the mean over every step "
            "(no warm-up left out, as the paper's table), and the median CPU time of planning a global batch.",
            (Table("table2.json", ("rows",), columns=(
                "row", "steps", "imbalance", "imbalance_p90", "ms_per_batch", "displacement_per_token",
                "delay_max", "release", "max_delay", "lookahead", "carried_tokens_end")),)),
    Section("exact", "Heuristics against exact solvers",
            "Gap of the heuristic packers to the CP-SAT / MILP optimum or its proven bound.",
            (Table("exact.json", ("summary",)),)),
    Section("frontier", "Certified imbalance-displacement frontier",
            "Lower bound on the aggregate imbalance (the sum over steps of the heaviest micro-batch's forward cost, "
            "times N, over the total) at each displacement budget (HiGHS), with the heuristics beside it. It bounds "
            "the aggregate, not the mean of the steps' imbalances (the `imbalance` columns elsewhere), which a plan "
            "within the budget may bring below it.",
            (Table("frontier.json", ("frontier",), caption="The frontier."),
             Table("frontier.json", ("heuristics",), caption="The heuristics on the same stream.")),
            meta_file="frontier.json", images="frontier.png"),
    Section("frontier", "Achievable imbalance-displacement frontier (offline schedules)",
            "Per distribution, the best schedule an offline search finds with the whole stream known, at each "
            "displacement budget, checked independently, beside the proven bound on the aggregate imbalance (1 "
            "where the solver proves nothing better within its time limit: then it brackets nothing); each default "
            "compared with the best schedule at no more displacement (of any reach up to the one compared with). "
            "Of the schedules a search finds, the one kept is the best on the reported imbalance. One search balances the forward cost (the measure), the other the forward plus backward "
            "cost, as the defaults do (at their displacements and at the balance targets' 0.40 and 0.45); the "
            "second runs again with each default's own reach (`max_lead`: the most steps a piece may train before "
            "it arrives; the whole-stream searches allow the model's window).",
            (Table("offline.json", ("offline",), caption="Offline schedules (checked) and the bound at each budget "
                   "(`full_share`: the share of steps filled to 99% of their token capacity).",
                   columns=("dist", "objective", "max_lead", "budget", "displacement_per_token", "imbalance",
                            "imbalance_bwd", "sim", "full_share", "aggregate", "bound", "source")),
             Table("offline.json", ("brackets",), caption="Each default against the offline schedules that balance "
                   "what it balances (forward plus backward cost), with its own reach (`lead_`: no piece trained more "
                   "than `max_lead` steps before it arrives: 0 without lookahead) and with the whole stream known "
                   "(`phases_`); `gap_achievable_*`: its imbalance minus theirs, at no more displacement.",
                   columns=("dist", "method", "max_lead", "imbalance", "displacement_per_token",
                            "lead_offline_imbalance", "lead_offline_displacement", "gap_achievable_lead",
                            "phases_offline_imbalance", "phases_offline_displacement", "gap_achievable_phases")),
             Table("offline.json", ("brackets",), caption="The defaults: achievable = their imbalance minus the best "
                   "offline schedule's at no more displacement, searched on the forward cost (`offline_`) and on "
                   "the forward plus backward cost (`phases_offline_`); `_bwd`: the same of the backward cost; "
                   "`sim`: the 1F1B pipeline's simulated step time over that of the same step with every "
                   "micro-batch at the mean; `full_share`: the share of their steps filled to 99% of the token "
                   "capacity; lower = their aggregate minus the bound.",
                   columns=("dist", "method", "imbalance", "imbalance_bwd", "sim", "full_share", "displacement_per_token",
                            "offline_imbalance", "offline_imbalance_bwd", "offline_sim", "offline_displacement",
                            "gap_achievable", "phases_offline_imbalance", "phases_offline_imbalance_bwd",
                            "phases_offline_sim", "phases_offline_displacement", "gap_achievable_phases",
                            "aggregate", "gap_achievable_aggregate", "bound", "gap_lower_aggregate"))),
            meta_file="offline.json", images="offline_*.png"),
    Section("frontier_fwd", "Achievable frontier with the defaults planned on the forward cost",
            "The same offline searches with the defaults planning on the forward phase alone (`--balance fwd`: the "
            "cost model's backward coefficients zero), the phase the imbalance measures, each bracketed by searches "
            "that balance the forward cost too: with the whole stream known and with its own reach (`max_lead`).",
            (Table("offline.json", ("offline",), caption="Offline schedules (checked) and the bound at each budget.",
                   columns=("dist", "objective", "max_lead", "budget", "displacement_per_token", "imbalance",
                            "imbalance_bwd", "sim", "full_share", "aggregate", "bound", "source")),
             Table("offline.json", ("brackets",), caption="Each forward-planned default against the forward "
                   "searches: with its own reach (`lead_`) and with the whole stream known (`offline_`); "
                   "`gap_achievable*`: its imbalance minus theirs, at no more displacement; `sim` as above.",
                   columns=("dist", "method", "max_lead", "imbalance", "imbalance_bwd", "sim",
                            "displacement_per_token", "lead_offline_imbalance", "lead_offline_displacement",
                            "gap_achievable_lead", "offline_imbalance", "offline_sim", "offline_displacement",
                            "gap_achievable", "bound", "gap_lower_aggregate"))),
            meta_file="offline.json", images="offline_*.png"),
    Section("shard", "CP sharding strategies",
            "Attention imbalance across CP ranks of each sharding strategy on packed micro-batches.",
            (Table("shard.json", ("summary",), caption="Per source, CP size and strategy, over all micro-batches.",
                   columns=("source", "cp", "strategy", "micro_batches", "imbalance", "max_imbalance", "max_ms",
                            "vs_per_seq", "vs_best_static", "short_share", "solve_ms_median")),
             Table("shard.json", ("paper_comparison_cp4",), caption="Gains at CP = 4, per source."),
             Table("shard.json", ("timing",), caption="Solve time per micro-batch."))),
    Section("parity", "Outlier-delay settings over several streams",
            "PP imbalance, displacement and the simulated 1F1B step time over balanced micro-batches (`sim`) of "
            "the packer's settings over independent streams.",
            (Table("parity.json", ("summary",)),)),
    Section("lookahead", "Lookahead at equal displacement",
            "The no-tuning defaults with lookahead K over several delay budgets (`PackerConfig.delay_budget`), "
            "so that each K draws a curve of displacement against imbalance; each K > 0 compared with K = 0 at "
            "no more displacement.",
            _lookahead_tables("At each K = 0 point: the lowest imbalance of a K point at no more displacement "
                              "(`at_or_below`; `holds`: no worse than K = 0; `-` where no K point displaces that "
                              "little), and the K curve read at K = 0's displacement (`interpolated`)."),
            images="lookahead.png"),
    Section("lookahead_n32", "Lookahead at equal displacement, 32 micro-batches",
            "The same comparison with 32 micro-batches per step (PP = 16 schedules), over the delay budgets "
            "around the default.",
            _lookahead_tables("As above, at 32 micro-batches."), images="lookahead.png"),
    Section("lookahead_fwd", "Lookahead at equal displacement, planned on the forward cost",
            "The same comparison with the packer planning on the forward phase alone (`--balance fwd`: the cost "
            "model's backward coefficients zero), the phase the imbalance columns measure. The defaults plan on "
            "both phases: compare `sim`, the simulated 1F1B step over that of balanced micro-batches, with the "
            "section above.",
            _lookahead_tables("As above, planned on the forward cost."), images="lookahead.png"),
    Section("lookahead_fwd_n32", "Lookahead at equal displacement, planned on the forward cost, 32 micro-batches",
            "The same comparison planned on the forward phase alone at 32 micro-batches per step, over the delay "
            "budgets around the default; compare with \"Lookahead at equal displacement, 32 micro-batches\".",
            _lookahead_tables("As above, planned on the forward cost, at 32 micro-batches."),
            images="lookahead.png"),
    Section("step_packers", "Step packers at unchanged pieces, and in the loop",
            "Each step of the defaults' plans re-packed by every step packer (its pieces, hence the displacement, "
            "unchanged), and by Algorithm 1 on the forward cost alone (`wlb_fwd`), with CP-SAT's optimum and "
            "proven bound on some steps; then the packer run with each method as its step packer.",
            (Table("step_packers.json", ("summary",), caption="Means over the streams of each kind (imbalance "
                   "as `bench parity` measures it, forward, after the warm-up; `_bwd`: the same of the backward cost; `_packing`: max / mean of the packing "
                   "cost; `_sim`: the 1F1B pipeline's simulated step time over that of the same step with every "
                   "micro-batch at the mean; `loop_*`: imbalance (backward) / displacement / median CPU ms per "
                   "step)."),
             Table("step_packers.json", ("regimes",), caption="The defaults' steps filled to 99% of their token "
                   "capacity (`full`) and the others, over the streams of each kind: `share` of the steps, the "
                   "defaults' mean forward imbalance on them (the stream's mean is the share-weighted mean of the "
                   "two), and on the steps CP-SAT solved (spread evenly over each stream), the packing imbalance of "
                   "Algorithm 1, of CP-SAT's plan and of its proven bound."))),
    Section("pack_speed", "Packing speed",
            "CPU time of `solve_pack` on one large global batch.",
            (Table("pack_speed.json", ("rows",)),)),
    Section("stream_speed", "Streaming planner speed",
            "CPU time of `WLBPacker.pack` per step with the no-tuning defaults, lookahead 0 and 4, with "
            "the packing loops in pure Python (the default install) and compiled (the `fast` extra); "
            "CP sharding of each step's micro-batches apart.",
            _STREAM_SPEED_TABLES),
    Section("stream_speed_full", "Streaming planner speed, 2,000 steps x 3 seeds",
            "The same measure over long streams: the defaults' step packer at 4 and 32 micro-batches, with the "
            "packing loops in pure Python (the default install) and compiled (the `fast` extra), the harness's own "
            "objects frozen out of garbage collection. With `repeats` R > 1 each stream is planned R times: "
            "`median_ms`, `p99_ms` and `worst_ms` are over each step's least time of the R passes (the same plans "
            "each pass; a shared machine only adds time), `median_of_runs_ms` is the median of the passes' own "
            "medians.",
            _STREAM_SPEED_TABLES),
    Section("stream_speed_dp", "Streaming planner speed with data-parallel replicas",
            "The same measure with dp replicas (`--dp`): global batches of dp x n_micro x window tokens, packed "
            "into dp x n_micro micro-batches and dealt n_micro to each replica by their modelled 1F1B time "
            "(`solvers.deal`).",
            (_STREAM_SPEED_TABLES[0], _STREAM_SPEED_TABLES[2])),
    Section("stream_speed_gpu_host", "Streaming planner speed on a GPU machine's CPU",
            "The long-stream measure on the host CPU of the H200 machine that ran the GPU check (16 Xeon cores, "
            "otherwise idle; 8 streams timed at once, each in its own process and CPU time), without CP sharding: "
            "planning runs on such a host in training. Run by hand on that machine: the command's output folder "
            "was one there, whose JSON is this section's folder.",
            (_STREAM_SPEED_TABLES[0],)),
    Section("pack_instructions", "Instructions per planning step",
            "What the streaming planner's `pack` executes, counted by valgrind (callgrind) inside the `pack` calls "
            "alone, pure-Python loops: a count that does not move with the load of a shared machine and repeats "
            "exactly, so it compares exact changes of the planner where CPU times cannot. Each row: the first seed's "
            "stream of `bench stream-speed`, planned for `steps` steps, and `counted` of them, evenly spaced after a "
            "20-step warm-up, packed again from their saved state (`scripts/pack_instructions.py` says how).",
            (Table("pack_instructions.json", ("rows",), caption="Millions of instructions per `pack` (mean over the "
                   "counted steps).", columns=("dist", "n_micro", "lookahead", "steps", "counted",
                                                "m_instructions_per_pack")),)),
    Section("validate_sim", "The simulator against real execution",
            "Predicted step time against measured steps of a 2-stage gloo pipeline, per schedule "
            "(error = predicted / measured - 1). `simulated_s`: the simulator on the measured op times as "
            "`simulate_step` times a pipeline (the replay of the executor's p2p: v = 2 its channels, v = 1 its groups), "
            "`dag_s` the ideal DAG; `replay_s`: the replay of the executor's p2p (v = 1: its groups) also fed what "
            "the step did outside its ops, measured on the executor's clocks (`setup_s` before the pipeline, "
            "`teardown_s` after it), with the profiled p2p per message, `replay_measured_p2p_s` with the median "
            "measured transfer per message (`transfer_ms`) instead; "
            "`load_average`: the 1-minute load average after each step.",
            (Table("validate_sim.json", ("rows",), columns=(
                "virtual_stages", "step", "measured_s", "simulated_s", "rel_error", "dag_s", "dag_rel_error",
                "replay_s", "replay_rel_error", "replay_measured_p2p_s", "replay_measured_p2p_rel_error", "setup_s",
                "teardown_s", "transfer_ms", "bubble_fraction", "predicted_s", "predicted_rel_error",
                "load_average")),
             Table("validate_sim.json", ("breakdown",)),
             Table("validate_sim.json", ("single_rank",)))),
    Section("pipeline_replay", "The executor's pipeline under rendezvous semantics",
            "Largest replay / ideal pipeline over random op times (log-normal around the cost model's), per "
            "shape: `executor`, what `train_step` runs (`p2p`: its groups for 1F1B, its channels for v > 1: a "
            "process group per ordered pair of ranks, sends waited on at the end of the step, the next receive "
            "posted ahead); beside it schedules of blocking groups for v > 1 (`groups`: the searched meetings of "
            "wlb_opt/p2p_meetings.json, found on other draws; `nominal`: each message where both ranks are idle "
            "at once in the nominal ideal timeline; `before`: Megatron's pairing of each op's sends with the next "
            "op's receives), all against the DAG in which sends never wait.",
            (Table("pipeline_replay.json", ("summary",), caption="Per v, over every shape."),
             Table("pipeline_replay.json", ("bounds",), caption="Lower bounds over every schedule of blocking "
                   "groups on the same draws (CP-SAT; `best_placement` is the best placement it found, fitted to "
                   "these draws; `best_placement_fresh` and `groups_fresh`: that placement and the searched groups "
                   "on other draws). Rows with a `draw` bound it on those few of the shape's draws alone (the "
                   "searched groups' slowest three together, then single draws: the best of the tries in `tried`, "
                   "in the JSON), beside the searched groups on them (`groups_on_draw`): the largest replay / ideal "
                   "over all the draws is at least that. What no blocking groups can reach, channels do."),
             Table("pipeline_replay.json", ("rows",), caption="Per shape."))),
    Section("memory", "Memory model against measured peaks",
            "Peak memory of one `train_step` on a CPU against the analytic and calibrated memory models.",
            (Table("memory.json", ("rows",)), Table("memory.json", ("summary",)))),
    Section("loss_memory", "Peak memory of the loss",
            "Forward and backward of the next-token loss, full logits against chunked.",
            (Table("loss_memory.json"),), meta_file="loss_memory_meta.json"),
    Section("cp_path", "CP attention's host path",
            "Host time of the index and copy path of CP attention, per layer: CPU time and wall time, "
            "medians of interleaved repeats, the load average beside them.",
            (Table("cp_path.json", ("host",)),)),
    Section("step_speed", "Training step against transformers' packed path",
            "Tokens/s of `train_step` (default chunked loss, and a full-logits loss like transformers') "
            "against transformers' sdpa forward and backward on the same micro-batches, one process on CPU: "
            "CPU time and wall time, medians over steps timed in rotating order, the load average beside them.",
            (Table("step_speed.json", ("rows",), columns=(
                "workload", "steps", "tokens_per_step", "wlb_cpu_tokens_per_s", "wlb_full_cpu_tokens_per_s",
                "transformers_cpu_tokens_per_s", "ratio_wlb_cpu", "ratio_wlb_full_cpu", "wlb_wall_tokens_per_s",
                "wlb_full_wall_tokens_per_s", "transformers_wall_tokens_per_s", "ratio_wlb_wall",
                "ratio_wlb_full_wall", "max_loss_rel_diff", "load_average")),)),
    Section("hf_throughput", "examples/train_hf.py on gloo ranks against its --hf-packed baseline",
            "Tokens/s of examples/train_hf.py under torch.distributed.run (gloo, CPU) against the same example's "
            "`--hf-packed` baseline (transformers' sdpa, one process) on the same documents and steps: CPU time "
            "(summed over the ranks) and wall time (the slowest rank), medians over steps of runs in rotating "
            "order, one thread per process, the 1-minute load average before and after each run beside them; "
            "on a machine with fewer cores than ranks the wall figures measure time-sharing.",
            (Table("hf_throughput.json", ("rows",), columns=(
                "config", "ranks", "steps", "tokens_per_step", "wlb_cpu_tokens_per_s", "hf_cpu_tokens_per_s",
                "ratio_cpu", "wlb_wall_tokens_per_s", "hf_wall_tokens_per_s", "ratio_wall", "max_loss_rel_diff",
                "load_average", "hf_load_average", "command", "hf_command")),)),
    Section("converge", "Convergence on real text",
            "Training loss and held-out loss of a small model under each batch ordering.",
            (Table("converge.json", ("summary",)),)),
    Section("kernel_schedule", "Launch order of the attention kernels (modelled)",
            "Worst makespan over ideal of each CP rank's work lists, list-scheduled on the device's SMs, "
            "for the heaviest-first 2-D grid ('before') and the current launch.",
            (Table("kernel_schedule.json", ("rows",)),)),
    Section("kernel", "Document-masked attention kernel",
            "Useful TFLOP/s of `doc_attention` against SDPA and FlexAttention on packed documents, single "
            "documents and equal documents of growing length (bf16, 32 query heads, 8 KV heads, head dim 128; "
            "baselines past the time budget are left out). " + _ON_THE_DEVICE,
            (Table("kernel_bench.json", ("cases",), caption="Per case, the median of 3 timed repeats (CUDA events) after a warm-up.", columns=(
                "case", "tokens", "n_docs", "max_doc", "fwd_gflop", "ours_fwd_ms", "ours_fwd_tflops",
                "ours_fwd_bwd_ms", "ours_fwd_bwd_tflops", "sdpa_fwd_tflops", "sdpa_fwd_bwd_tflops",
                "flex_fwd_tflops", "flex_fwd_bwd_tflops")),
             Table("kernel_bench.json", ("correctness",), caption="Against an fp32 reference, beside the error of "
                   "the same computation done in bf16 by PyTorch."),
             Table("kernel_bench.json", ("scaling_fit",), caption="Time against the sum of squared document "
                   "lengths at equal tokens."))),
    Section("cp_path_gpu", "CP attention on one GPU",
            "One rank's CP attention layer (forward and backward) on a CUDA device under NCCL: device time per "
            "layer, and the host index path's CPU and wall time per layer. " + _ON_THE_DEVICE,
            (Table("cp_path.json", ("full",), caption="The whole layer."),
             Table("cp_path.json", ("host",), caption="The host index path."))),
    Section("cost_check", "The analytic cost model against a measured one",
            "The analytic model of the measured model's architecture on the hardware preset, against the "
            "measured model (`wlb-opt bench cost-check`): coefficients, micro-batches of equal documents, and the "
            "default packer planning with each model, both plans scored with the measured one.",
            (Table("cost_check.json", ("coefficients",), caption="Per phase and term, seconds (per causal pair, "
                   "token, document, micro-batch; the whole model)."),
             Table("cost_check.json", ("mixes",), caption="A micro-batch split into equal documents, seconds."),
             Table("cost_check.json", ("planning",), caption="Means over the streams: per-step imbalance after a "
                   "20-step warm-up, both scored with the measured model, and displacement per token."))),
    Section("profile_7b", "A 7B block profiled on one GPU",
            "`wlb-opt profile` on one 7B block (bf16): the fitted cost model (seconds per term, for the whole "
            "model), its error on held-out micro-batches, the attention latency over 128K keys, and the "
            "memory calibration from the CUDA allocator's peaks. " + _ON_THE_DEVICE,
            (Table("cost_7b.json", ("coef",), caption="Fitted coefficients, forward and backward."),
             Table("cost_7b.json", ("meta", "validation"), caption="Mean and worst absolute percentage error "
                   "on held-out micro-batches."),
             Table("cost_7b.json", ("meta", "attention_latency"), caption="Forward attention latency."),
             Table("cost_7b.json", ("meta", "memory_calibration", "measured"), caption="Measured peaks (bytes).")),
            provenance=("meta", "provenance")),
)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _columns(rows: list[dict], wanted: tuple[str, ...] | None) -> list[str]:
    if wanted is not None:
        return [c for c in wanted if any(c in r for r in rows)]
    seen: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in seen and _scalar(v):
                seen.append(k)
    return [c for c in seen if all(_scalar(r.get(c)) for r in rows)]


def render_table(rows, columns: tuple[str, ...] | None = None) -> list[str]:
    """Markdown lines of a list of objects (a dict of objects reads as rows keyed by name)."""
    if isinstance(rows, dict):
        rows = [dict(name=k, **v) if isinstance(v, dict) else dict(name=k, value=v) for k, v in rows.items()
                if isinstance(v, dict) or _scalar(v)]  # a list inside stays in the JSON
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return []
    cols = _columns(rows, columns)
    if not cols:
        return []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows[:MAX_ROWS]:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
    if len(rows) > MAX_ROWS:
        lines.append(f"\n{len(rows) - MAX_ROWS} more rows in the JSON.")
    return lines


def _dig(data, path: tuple[str, ...]):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def _provenance_lines(provenance: dict | None) -> list[str]:
    if not isinstance(provenance, dict):
        return ["Command and machine: not recorded in the JSON."]
    m = provenance.get("machine") or {}
    machine = ", ".join(f"{k} {m[k]}" for k in ("platform", "python", "cpu_count", "torch", "accelerator")
                        if m.get(k) is not None)
    lines = ["```bash", str(provenance.get("command", "?")), "```", "", f"Machine: {machine or 'not recorded'}."]
    code = provenance.get("code")
    if isinstance(code, dict) and code.get("version"):  # recorded from this version of the package on
        commit = f", commit {code['commit']}" if code.get("commit") else ""
        lines[-1] += f" Code: wlb-opt {code['version']}{commit}."
    return lines


def _auto_tables(folder: Path) -> tuple[Table, ...]:
    tables = []
    for f in sorted(folder.glob("*.json")):
        data = _load(f)
        if isinstance(data, list):
            tables.append(Table(f.name))
        elif isinstance(data, dict):
            tables += [Table(f.name, (k,)) for k, v in data.items()
                       if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
    return tuple(tables)


def render_section(section: Section, root: Path, link_base: str) -> list[str]:
    """Lines of one benchmark's part of the page ([] when its folder holds no JSON)."""
    folder = root / section.folder
    if not folder.is_dir() or not any(folder.glob("*.json")):
        return []
    if section.meta_file and not (folder / section.meta_file).exists():
        return []  # a section of a file this folder does not hold (yet)
    tables = section.tables or _auto_tables(folder)
    meta_file = section.meta_file or (tables[0].file if tables else sorted(folder.glob("*.json"))[0].name)
    meta = _load(folder / meta_file) if (folder / meta_file).exists() else None
    lines = [f"## {section.title}", "", section.what, ""]
    lines += _provenance_lines(_dig(meta, section.provenance)) + [""]
    for t in tables:
        path = folder / t.file
        if not path.exists():
            continue
        body = render_table(_dig(_load(path), t.path), t.columns)
        if body:
            where = f"`{t.file}`" + (f" → `{'.'.join(t.path)}`" if t.path else "")
            lines += ([t.caption + f" From {where}.", ""] if t.caption else [f"From {where}.", ""]) + body + [""]
    for png in sorted(folder.glob(section.images)):
        lines += [f"![{png.stem}]({link_base}/{section.folder}/{png.name})", ""]
    return lines


def render(root: Path = RESULTS, output: Path = OUTPUT) -> str:
    """The text of docs/results.md for the JSON under `root` (links relative to `output`'s folder)."""
    root = Path(root)
    try:
        link_base = root.resolve().relative_to(Path(output).resolve().parent).as_posix()
    except ValueError:
        link_base = root.resolve().as_posix()
    named = {s.folder for s in SECTIONS}
    extra = [Section(p.name, p.name.replace("_", " ").capitalize(), f"`wlb-opt bench {p.name.replace('_', '-')}`.")
             for p in sorted(root.glob("*")) if p.is_dir() and p.name not in named]
    lines = ["# Results", "",
             "Generated by `wlb-opt bench report` from the JSON under "
             f"[{link_base}/]({link_base}/); do not edit by hand. Each section names the command "
             "that wrote its JSON (from the repository root) and the machine it ran on; rerunning "
             "that command and then `wlb-opt bench report` updates it. "
             "What each benchmark measures: [benchmarks.md](benchmarks.md).", ""]
    for section in (*SECTIONS, *extra):
        lines += render_section(section, root, link_base)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench report", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help=f"folder of the JSON summaries (default {RESULTS})")
    p.add_argument("--output", type=Path, default=OUTPUT, help=f"the page to write or check (default {OUTPUT})")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page differs from the JSON")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        raise ValueError(f"--results {args.results} is not a folder (run from the repository root)")
    text = render(args.results, args.output)
    if args.check:
        current = args.output.read_text() if args.output.exists() else None
        if current != text:
            state = "is missing" if current is None else "differs from what the JSON gives"
            print(f"wlb-opt bench report: {args.output} {state}; run `wlb-opt bench report` to regenerate it",
                  file=sys.stderr)
            return 1
        print(f"{args.output} matches {args.results}")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0
