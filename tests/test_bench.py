"""The benchmark suite's arithmetic and report (scripts/bench.py): fast, no Ray, no timing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from argparse import Namespace

import pytest

from scripts.benchmarks import (
    boosting,
    ddp_throughput,
    fixed_cost,
    lm_throughput,
    memory,
    recovery,
)
from scripts.benchmarks.common import REPO, Goal, median, order_for, paired_ratios, ratio
from scripts.benchmarks.proctree import cpu_between, kind_of, summarize_peaks, title_of
from scripts.benchmarks.report import figure_rows, markdown


def test_help_lists_every_benchmark():
    out = subprocess.run([sys.executable, "scripts/bench.py", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for name in ("ddp_throughput", "fixed_cost", "recovery", "boosting", "memory",
                 "lm_throughput", "all"):
        assert name in out.stdout


def test_ratios_medians_and_goals():
    assert median([3.0, 1.0, 2.0, None]) == 2.0 and median([None]) is None
    assert ratio(1.0, 4.0) == 0.25 and ratio(None, 1.0) is None and ratio(1.0, 0.0) is None
    assert paired_ratios([1.0, 3.0], [2.0, 3.0]) == [0.5, 1.0]
    assert Goal(">=", 0.97).met(0.97) and not Goal(">=", 0.97).met(0.96)
    assert Goal("<=", 1.0).met(0.5) and Goal("<=", 1.0).met(None) is None
    assert str(Goal("<=", 1.0)) == "<= 1"


def test_sides_alternate_which_goes_first():
    assert order_for(0, ["a", "b", "c"]) == ["a", "b", "c"]
    assert order_for(1, ["a", "b", "c"]) == ["c", "b", "a"]


def test_ddp_throughput_ratios_come_from_medians():
    runs = {"orchestrator": [{"steady_samples_per_s": v} for v in (90, 100, 95)],
            "ray_train": [{"steady_samples_per_s": v} for v in (100, 100, 100)],
            "torchrun": [{"steady_samples_per_s": v} for v in (120, 125, 130)]}
    out = ddp_throughput.summarize({}, runs)
    assert out["figures"]["vs_ray_train"] == {"value": 0.95, "goal": ">= 0.97", "met": False}
    assert out["figures"]["vs_torchrun"]["value"] == 0.76
    assert out["paired_vs_ray_train"] == [0.9, 1.0, 0.95]


def test_lm_throughput_against_a_plain_loop():
    runs = {"orchestrator": [{"steady_tokens_per_s": v} for v in (900, 950, 1000)],
            "plain_torch": [{"steady_tokens_per_s": v} for v in (1000, 1000, 1000)]}
    out = lm_throughput.summarize(Namespace(lm_steps=300, lm_threads=2), runs)
    assert out["figures"]["vs_plain_torch"] == {"value": 0.95, "goal": ">= 0.9", "met": True}
    assert out["paired_vs_plain_torch"] == [0.9, 0.95, 1.0]


def test_cpu_seconds_in_a_window_are_interpolated():
    series = {1: [(10.0, 1.0), (12.0, 3.0), (14.0, 3.0)], 2: [(10.0, 0.0), (14.0, 4.0)]}
    assert cpu_between(series, 11.0, 13.0) == 1.0 + 2.0
    assert cpu_between(series, 0.0, 100.0) == 2.0 + 4.0  # flat outside the samples
    spec = {"steps": 11, "batch_size": 100}
    assert ddp_throughput.per_cpu_second(spec, series, 11.0, 13.0) == round(1000 / 3.0, 1)
    assert ddp_throughput.per_cpu_second(spec, {}, 11.0, 13.0) is None
    rec = {"started_at": 100.0, "world_sizes": [{"size": 2, "step": 0, "first_step_at_s": 5.0}]}
    assert ddp_throughput.steady_window_start(rec) == 105.0


def test_fixed_cost_figures_and_variants():
    runs = {"orchestrator": [{"to_exit_s": 20.0, "to_first_step_s": 15.0}] * 2,
            "ray_train": [{"to_exit_s": 25.0, "to_first_step_s": 15.0}] * 2,
            "orchestrator_no_dashboard": [{"to_exit_s": 15.0, "to_first_step_s": 12.0}] * 2}
    figs = fixed_cost.summarize({}, runs)["figures"]
    assert figs["to_exit_s_vs_ray_train"]["value"] == 0.8 and figs["to_exit_s_vs_ray_train"]["met"]
    assert figs["to_first_step_s_vs_ray_train"]["value"] == 1.0
    assert figs["to_exit_s_no_dashboard_vs_ray_train"]["value"] == 0.6
    assert "cpu_s_vs_ray_train" not in figs  # no CPU figures in these runs
    # One variant per speed hook, each switching off that hook alone (issue 66's table).
    from orchestrator.ray_internals.versions import HOOK_NAMES, SPEED_HOOKS_OFF

    assert all(fixed_cost.VARIANTS[f"no_{name}"] == ([], {SPEED_HOOKS_OFF: name})
               for name in HOOK_NAMES)


def test_fixed_cost_against_torchrun_cold_and_warm():
    runs = {"orchestrator": [{"to_exit_s": 20.0, "to_first_step_s": 15.0}] * 2,
            "ray_train": [{"to_exit_s": 25.0, "to_first_step_s": 15.0}] * 2,
            "torchrun": [{"to_exit_s": 5.0, "to_first_step_s": 3.0}] * 2,
            "orchestrator_warm": [{"to_exit_s": 6.0, "to_first_step_s": 4.5}] * 2}
    figs = fixed_cost.summarize({}, runs)["figures"]
    assert figs["to_exit_s_vs_torchrun"] == {"value": 4.0, "goal": "<= 2", "met": False,
                                             "paired": [4.0, 4.0]}
    assert figs["to_exit_s_warm_vs_torchrun"]["value"] == 1.2
    assert figs["to_exit_s_warm_vs_torchrun"]["met"]
    assert figs["to_first_step_s_vs_torchrun"]["value"] == 5.0
    assert "goal" not in figs["to_first_step_s_vs_torchrun"]  # reported beside it


def test_fixed_cost_cpu_profile_by_process_title():
    def run(cpu, titles):
        return {"to_exit_s": 1.0, "to_first_step_s": 1.0,
                "memory": {"cpu_s": cpu, "cpu_s_by_title": titles}}

    runs = {"orchestrator": [run(40.0, {"ray::RunRecorder": 2.0}), run(44.0, {})],
            "ray_train": [run(50.0, {"raylet": 1.0}), run(50.0, {"raylet": 3.0})]}
    out = fixed_cost.summarize({}, runs)
    assert out["cpu_s_profile"]["orchestrator"] == {"ray::RunRecorder": 1.0, "total": 42.0}
    assert out["cpu_s_profile"]["ray_train"]["raylet"] == 2.0
    assert out["figures"]["cpu_s_vs_ray_train"]["value"] == 0.84


def test_recovery_against_cold_start():
    runs = [{"cold_start_s": 30.0, "recovery_s": 12.0, "to_group_started_s": 10.0},
            {"cold_start_s": 20.0, "recovery_s": 14.0, "to_group_started_s": 11.0}]
    fig = recovery.summarize(runs)["figures"]["recovery_vs_cold_start"]
    assert fig["value"] == 0.52 and fig["met"] and fig["aim_met"] is False
    assert fig["paired"] == [0.4, 0.7]


def test_boosting_ratios_and_metric_difference():
    runs = {"xgboost_orchestrated": [{"wall_s": 40.0, "train_s": 8.0,
                                      "metrics": {"test_auc": 0.95, "test_logloss": 0.2}}],
            "xgboost_single": [{"wall_s": 10.0, "train_s": 4.0,
                                "metrics": {"test_auc": 0.951, "test_logloss": 0.2}}]}
    figs = boosting.summarize(1000, runs, ["xgboost"])["figures"]
    assert figs["xgboost_wall_s_ratio"]["value"] == 4.0
    assert figs["xgboost_train_s_ratio"]["value"] == 2.0
    assert figs["xgboost_metric_difference"] == {"test_auc": -0.001, "test_logloss": 0.0}
    assert boosting.train_s({"samples": 500, "samples_per_s": 100.0}) == 5.0


def test_memory_peaks_by_kind():
    assert kind_of("python -m orchestrator", True) == "driver"
    assert kind_of("ray::RayTrainWorker.run_train_fn", False) == "train_worker"
    assert kind_of("/x/raylet --node", False) == "ray_system"
    assert title_of("ray::TrainController.run") == "ray::TrainController"
    assert title_of("/v/bin/python -u /v/ray/_private/log_monitor.py --x") == "log_monitor.py"
    peaks = summarize_peaks({1: 2048, 2: 1024, 3: 3072, 4: 512},
                            {1: "driver", 2: "train_worker", 3: "train_worker", 4: "ray_system"},
                            8192)
    assert peaks["driver_mib"] == 2.0 and peaks["train_workers_mib"] == [3.0, 1.0]
    assert peaks["tree_rss_peak_mib"] == 8.0
    side = {"driver_mib": 400.0, "train_workers_mib": [600.0, 500.0], "tree_rss_peak_mib": 3000.0}
    base = {"driver_mib": 200.0, "train_workers_mib": [500.0, 500.0], "tree_rss_peak_mib": 3000.0}
    figs = memory.summarize({"orchestrator": [side], "ray_train": [base]})["figures"]
    assert figs["driver_ratio"]["value"] == 2.0 and figs["worker_max_ratio"]["value"] == 1.2


def test_report_has_a_row_per_figure():
    doc = {"command": "python scripts/bench.py all", "date": "2026-11-22", "elapsed_s": 1.0,
           "machine": {"cpus": 2, "memory_gib": 24, "python": "3.11", "ray": "2.60.0",
                       "torch": "2.13.0"},
           "loadavg_start": [1, 1, 1], "loadavg_end": [1, 1, 1],
           "benchmarks": {"recovery": recovery.summarize([{"cold_start_s": 30.0, "recovery_s": 12.0,
                                                           "to_group_started_s": 10.0}]),
                          "memory": {"error": "RuntimeError: boom"}}}
    rows = figure_rows(doc)
    assert ("recovery", "recovery_vs_cold_start", "0.400", "<= 1", "yes (aim 0.5: yes)") in rows
    assert rows[-1][:2] == ("memory", "error")
    assert "| recovery | recovery_vs_cold_start |" in markdown(doc)


@pytest.mark.parametrize("argv", [["all"], ["ddp_throughput", "--repeats", "1"]])
def test_arguments_parse(argv):
    spec = importlib.util.spec_from_file_location("bench_cli", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parser().parse_args(argv)
    assert args.name == argv[0] and isinstance(args, Namespace)



def test_fsdp_figures():
    from scripts.benchmarks import fsdp_checkpoint, fsdp_memory

    peak = {"baseline@2": 500, "ddp@2": 2500, "fsdp@2": 1500,
            "baseline@4": 500, "ddp@4": 2500, "fsdp@4": 1000}
    figs = fsdp_memory.summarize({k: {"worker_max_mib": v} for k, v in peak.items()})["figures"]
    assert figs["peak_rss_fsdp_vs_ddp_at_2"] == {"value": 0.6, "goal": "<= 0.6", "met": True}
    assert figs["above_baseline_fsdp_vs_ddp_at_4"]["value"] == 0.25
    def ckpt(step: int, save_s: float, write_s: float = 0.0) -> dict:
        return {"step": step, "bytes": 1 << 30, "save_s": save_s, "write_s": write_s, "upload_s": 8.0}

    # The last checkpoint (written directly at the run's end) is left out of the blocked times.
    out = fsdp_checkpoint.summarize(
        {"async": {"checkpoints": [ckpt(1, 0.5), ckpt(2, 3.0)]},
         "sync": {"checkpoints": [ckpt(1, 0.5, 1.5), ckpt(2, 3.0)]}},
        {"bytes": 1 << 30, "seconds": 7.2, "shard_bytes_by_rank": {0: 1 << 29, 1: 1 << 29}},
        [{"rank": 0, "added_mib": 60.0, "shard_mib": 600.0}])["figures"]
    assert out["blocked_async_vs_sync"]["value"] == round(0.5 / (0.5 + 1.5 + 8.0), 3)
    assert out["upload_vs_raw_pyarrow"]["value"] == 0.9
    assert out["memory_added_vs_shard"] == {"value": 0.1, "goal": "<= 1.2", "met": True}
