"""A sweep: trials on Ray Tune in one Ray session, then sweep.json and the scaling report.

The sweep's directory is named after the sweep (derived from its overrides and search unless
hydra.sweeper.name is given), so the same command finds it again: Tune's experiment state
there lets a rerun skip the trials that finished and run the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from orchestrator.config.schema import ClusterConfig
from orchestrator.errors import ConfigError, print_error
from orchestrator.sweep.config import RayTuneSweeperConf
from orchestrator.sweep.metric import needs_metric
from orchestrator.sweep.report import write_report
from orchestrator.sweep.space import SweepSpace, build_space, check_search, tune_space
from orchestrator.sweep.tracking import end_parent, open_parent
from orchestrator.sweep.trial import TrialContext, read_record, run_trial

log = logging.getLogger("orchestrator")


class NoTunerRestoreAdvice(logging.Filter):
    """Tune's "Experiment has been interrupted ... Resume experiment with: Tuner.restore(...)"
    after a Ctrl-C is not how a sweep goes on: the same command runs the rest, as the sweep
    then says."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tuner.restore(" not in record.getMessage()


TUNE_LOGGER = "ray.tune.tune"

TUNE_DIR = "tune"


IDENTITY = "sweep-identity.json"  # what the sweep in a folder is: a rerun must be the same


def sweep_identity(config: DictConfig, space: SweepSpace, conf: RayTuneSweeperConf) -> dict:
    """What makes two commands the same sweep: the trials, the search, and how many run at
    once (a rerun with hydra.sweeper.max_concurrent=1 asks for solo figures: a new sweep)."""
    return json.loads(json.dumps({
        "fixed": sorted(space.fixed),
        "dims": [[d.key, list(d.values), d.low, d.high, d.log, d.integer] for d in space.dimensions],
        "search": [conf.search, conf.num_samples, conf.metric, conf.mode],
        "early_stopping": OmegaConf.to_container(OmegaConf.structured(conf.early_stopping)),
        "seed": config.get("seed"),
        "max_concurrent": conf.max_concurrent,
    }, sort_keys=True, default=str))


def sweep_name(config: DictConfig, space: SweepSpace, conf: RayTuneSweeperConf) -> str:
    if conf.name:
        return conf.name
    key = json.dumps(sweep_identity(config, space, conf), sort_keys=True)
    trainer = OmegaConf.select(config, "trainer.name", default="sweep")
    return f"{trainer}-sweep-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def another_sweep_there(sweep_dir: Path, identity: dict) -> str | None:
    """The one-line refusal when the folder holds a sweep other than this command's (a
    hydra.sweep.dir or hydra.sweeper.name given again with other trials): resuming it would
    run the old trials under the new command's name."""
    try:
        before = json.loads((sweep_dir / IDENTITY).read_text())
    except (OSError, ValueError):
        return None
    if before == identity:
        return None
    differ = sorted(k for k in identity if before.get(k) != identity[k])
    return (f"{sweep_dir} holds another sweep (its {', '.join(differ)} differ from this "
            "command's): give another hydra.sweep.dir (or hydra.sweeper.name), or remove that "
            "folder to start this sweep there")


def sweep_directory(config: DictConfig, name: str) -> Path:
    """hydra.sweep.dir as given on the command line, else <hydra.sweep.dir>/<sweep name>."""
    given = any(o.split("=", 1)[0].lstrip("+~") == "hydra.sweep.dir"
                for o in config.hydra.overrides.hydra)
    base = Path(str(config.hydra.sweep.dir))
    return (base if given else base / name).resolve()


def concurrency(conf: RayTuneSweeperConf, total_cpus: float, trials: int | None,
                total_gpus: float = 0.0, gpus_a_trial: float = 0.0) -> int:
    """The cap on trials at once: hydra.sweeper.max_concurrent, else one per CPU (at least 2,
    at most 4; a trial spends most of its first seconds starting processes, not computing).
    Trials that use GPUs: no more at once than the cluster's GPUs hold, the largest trial's
    worth each (a trial left waiting for a GPU would fail at cluster.placement_timeout_s)."""
    cap = conf.max_concurrent or min(4, max(2, int(total_cpus)))
    if gpus_a_trial > 0:
        cap = min(cap, max(1, int(total_gpus // gpus_a_trial)))
    return max(1, min(cap, trials)) if trials else cap


def most_gpus_a_trial_asks(cluster: ClusterConfig, space: SweepSpace) -> float:
    """cluster.workers x cluster.gpus_per_worker at their largest over the trials (each key's
    largest value: a bound, not a trial's own sum)."""

    def largest(key: str, default: float) -> float:
        values: list = [default]
        for line in space.fixed:
            given, _, value = line.partition("=")
            if given.lstrip("+~") == key:
                values = [value]
        for dim in space.dimensions:
            if dim.key == key:
                values = list(dim.values) if dim.discrete else [dim.high]
        numbers = []
        for value in values:
            try:
                numbers.append(float(value))
            except (TypeError, ValueError):  # an interpolation: its own default stands
                numbers.append(default)
        return max(numbers)

    return largest("cluster.workers", cluster.workers) * \
        largest("cluster.gpus_per_worker", cluster.gpus_per_worker)


def search_algorithm(conf: RayTuneSweeperConf, seed: int, at_once: int):
    from ray.tune.search import BasicVariantGenerator

    if conf.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=seed)  # Tune caps its concurrency (max_concurrent_trials)
    # A generator takes its own cap: Tune ignores max_concurrent_trials for it.
    return BasicVariantGenerator(random_state=seed, max_concurrent=at_once)


def scheduler(conf: RayTuneSweeperConf):
    es = conf.early_stopping
    if not es.enabled:
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="step", grace_period=es.grace_period,
                         reduction_factor=es.reduction_factor, max_t=es.max_t)


def run_sweep(conf: RayTuneSweeperConf, hydra_context, config: DictConfig,
              arguments: list[str]) -> int:
    """Run every trial; return the exit code (0 when no trial failed)."""
    from hydra.core.singleton import Singleton

    started = time.time()
    space = build_space(arguments, dict(conf.params))
    check_search(space, conf.search)
    name = sweep_name(config, space, conf)
    sweep_dir = sweep_directory(config, name)
    identity = sweep_identity(config, space, conf)
    if refusal := another_sweep_there(sweep_dir, identity):
        print_error(refusal)
        return 2
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / IDENTITY).write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
    cluster: ClusterConfig = OmegaConf.to_object(config.cluster)  # typed by the schema
    grid = space.grid_size * conf.num_samples if conf.search == "grid" else conf.num_samples
    if conf.search != "grid" and conf.num_samples == 1:
        log.warning("hydra.sweeper.search=%s draws hydra.sweeper.num_samples=1 trial: set "
                    "num_samples to the trials you want", conf.search)

    from orchestrator.ray_internals.cluster import without_token_auth_notice

    without_token_auth_notice()
    try:
        parent = open_parent(config, name, sweep_dir, space)  # the trials' runs nest in it
    except ConfigError as exc:
        print_error(str(exc))
        return 2
    with sweep_session(config, cluster, space) as session:
        if session.dashboard_url:
            log.info("Ray dashboard: %s (%s)", session.dashboard_url,
                     session.dashboard_token_hint())
        total = session.total_cpus()
        at_once = concurrency(conf, total, grid, session.total_gpus(),
                              most_gpus_a_trial_asks(cluster, space))
        budget = round(total / at_once, 3)  # CPUs per trial, shared by its workers
        ctx = TrialContext(hydra_context, config, Singleton.get_state(), space, str(sweep_dir),
                           name, conf.metric, budget,
                           run_name=config.run.name or name, command_dir=os.getcwd(),
                           metric_required=needs_metric(conf),
                           tracking_parent=(parent.run_id, parent.experiment) if parent else None)
        tuner = make_tuner(conf, ctx, sweep_dir, grid, at_once, int(config.get("seed", 0)))
        logging.getLogger(TUNE_LOGGER).addFilter(NoTunerRestoreAdvice())
        with StopOnCtrlC() as ctrl_c:
            try:
                results = tuner.fit()
            finally:  # a joined cluster outlives the sweep: nothing of its trials stays there
                release_trial_groups(session)
        rows = [trial_row(r, space, cluster.workers, ctrl_c.seen) for r in results]
    if ctrl_c.seen:  # the trials the search had not drawn yet: the same command runs them
        rows += [not_started(i) for i in range(grid - len(rows))]
    summary = summarize(conf, name, sweep_dir, space, rows, at_once, budget, started)
    return reported(summary, sweep_dir, ctrl_c.seen, parent)


def reported(summary: dict, sweep_dir: Path, interrupted: bool, parent) -> int:
    """sweep.json, the scaling report (on the terminal, and the sweep's MLflow run's); the
    sweep's exit code."""
    summary["status"] = "interrupted" if interrupted else "done"
    paths = write_report(summary, sweep_dir)
    failed = [r for r in summary["trials"] if r["status"] == "failed"]
    print_summary(summary, paths, failed)
    code = 130 if interrupted else 1 if failed else 0
    end_parent(parent, code, paths)
    if interrupted:
        log.warning("sweep %s interrupted: finished trials are kept; the same command runs the "
                    "rest, each from its newest checkpoint", summary["name"])
    return code


def release_trial_groups(session) -> None:
    """What the sweep's trials still hold on a cluster that outlives the sweep (a joined one:
    an embedded Ray ends with it), removed once their controllers are gone."""
    if not session.joined:
        return
    from orchestrator.ray_internals.pg_cleaner import release_the_jobs_groups

    try:
        release_the_jobs_groups()
    except Exception as exc:  # noqa: BLE001  (the cluster going away: it frees them itself)
        log.warning("the placement groups of the sweep's trials were not checked: %s", exc)


@contextmanager
def sweep_session(config: DictConfig, cluster: ClusterConfig, space: SweepSpace):
    """The Ray session all trials run in, with its fork server where one serves."""
    from orchestrator.driver.backends import backend_named
    from orchestrator.driver.ray_session import RaySession, user_pythonpath
    from orchestrator.ray_internals import fork_server
    from orchestrator.ray_internals.train_hooks import controller_env

    # Trials import the user's modules (a trainer.fn or _target_ of theirs) from the command's
    # directory, which Ray puts on every process's sys.path (launch.worker_env says why not
    # through PYTHONPATH). The controllers of all trials share the session's environment: the
    # base trainer's backend's knobs.
    backend = backend_named(str(config.trainer.get("backend", "torch")))
    env = {**controller_env(float(config.failure.hang_timeout_s), backend), **user_pythonpath()}
    # Trials print through Ray's worker-output channel (no recorder of the sweep relays them
    # yet), so a sweep streams it whatever log.ray_verbose says.
    with fork_server.socket_dir(forks(cluster, space)) as sock, \
            RaySession(cluster, env, verbose=True,
                       py_executable=fork_server.client_executable(sock) if sock else None) \
            as session, fork_server.serving(sock, backend.fork_imports, env):
        yield session


def forks(cluster: ClusterConfig, space: SweepSpace) -> bool:
    """Whether the trials' processes fork from a server with what they import already imported
    (ray_internals/fork_server/): on an embedded cluster (one job, one node), not for GPU
    trials, nor trials of another trainer, nor where a service's Ray is open already."""
    from orchestrator.ray_internals import fork_server

    return cluster.address is None and most_gpus_a_trial_asks(cluster, space) == 0 and \
        one_backend(space) and not ray_is_initialized() and fork_server.usable()


def one_backend(space: SweepSpace) -> bool:
    """Every trial has the base config's trainer and backend (the fork server imports that
    backend's framework: another's workers would start beside it)."""
    keys = [line.partition("=")[0].lstrip("+~") for line in space.fixed]
    keys += [dim.key for dim in space.dimensions]
    return not any(key in ("trainer", "trainer.backend") for key in keys)


def ray_is_initialized() -> bool:
    """A service's Ray, open before this sweep (its job's runtime environment is set)."""
    import ray

    return ray.is_initialized()


def make_tuner(conf: RayTuneSweeperConf, ctx: TrialContext, sweep_dir: Path, grid: int,
               at_once: int, seed: int):
    """A new Tune run of the sweep's trials, or the one this sweep folder holds, restored."""
    from ray import tune

    from orchestrator.sweep.placement_groups import RemoveOrphanedGroups

    trainable = tune.with_resources(tune.with_parameters(run_trial, ctx=ctx),
                                    {"CPU": 0, f"node:{node_ip()}": 0.001})
    tune_path = sweep_dir / TUNE_DIR
    if tune.Tuner.can_restore(str(tune_path)):
        log.info("sweep %s: resuming in %s (finished trials are not run again)", ctx.sweep_name,
                 sweep_dir)
        # resume_errored keeps the trial id, hence its directory and checkpoints (restart_errored
        # would make a new trial).
        return tune.Tuner.restore(str(tune_path), trainable, resume_errored=True)
    log.info("sweep %s: %s trials, %d at a time, in %s", ctx.sweep_name, grid, at_once, sweep_dir)
    return tune.Tuner(
        trainable,
        param_space=tune_space(ctx.space, conf.search),
        tune_config=tune.TuneConfig(
            # Only a search or a scheduler that compares trials needs the metric from every
            # trial; the sweep picks its best itself, among those that report it.
            metric=conf.metric if needs_metric(conf) else None,
            mode=conf.mode if needs_metric(conf) else None,
            num_samples=conf.num_samples,
            search_alg=search_algorithm(conf, seed, at_once),
            scheduler=scheduler(conf),
            # A trial's actor (a process importing Ray, Tune, Hydra and the orchestrator's
            # driver) runs the next trial too, unless a scheduler may stop trials early: a
            # stopped trial's run would go on in it beside the next one.
            reuse_actors=not conf.early_stopping.enabled,
            max_concurrent_trials=at_once if conf.search == "optuna" else None,
            trial_dirname_creator=lambda trial: trial.trial_id),
        run_config=tune.RunConfig(name=TUNE_DIR, storage_path=str(sweep_dir), verbose=0,
                                  callbacks=[RemoveOrphanedGroups()]),
    )


class StopOnCtrlC:
    """Ctrl-C ends the sweep like Tune's own handler (its state saved, trials stopped), and the
    sweep knows it was interrupted: Tune's handler is swapped for one that says so, then asks
    Tune to stop through SIGUSR1, which Tune handles the same way."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._previous = None

    @property
    def seen(self) -> bool:
        return self._event.is_set()

    def _on_sigint(self, signum, frame) -> None:
        if self._event.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self._event.set()
        log.warning("interrupted: stopping the trials (Ctrl-C again to stop at once)")
        os.kill(os.getpid(), signal.SIGUSR1)

    def __enter__(self) -> StopOnCtrlC:
        if threading.current_thread() is threading.main_thread():
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


# What a trial's report holds besides the run's metrics: the sweep's own figures and Tune's.
BOOKKEEPING = {"step", "final", "workers", "world_size", "samples_per_s", "restarts", "preemptions",
               "wall_s", "time_this_iter_s", "time_total_s", "timestamp", "training_iteration",
               "pid", "time_since_restore", "iterations_since_restore", "done", "trial_id",
               "date", "hostname", "node_ip", "experiment_tag", "checkpoint_dir_name",
               "should_checkpoint"}


def trial_row(result, space: SweepSpace, default_workers: int, interrupted: bool = False) -> dict:
    metrics = dict(result.metrics or {})
    params = {d.key: result.config[d.key] for d in space.dimensions if d.key in result.config}
    overrides = [d.override(params[d.key]) for d in space.dimensions if d.key in params]
    path = Path(result.path)
    run = read_record(path.parents[1] / path.name / "run.json") or {}
    if metrics.get("final"):
        status = "succeeded"
    elif run.get("status") in ("succeeded", "already_finished"):
        # The run ended (and said so) before Tune took its final report: a Ctrl-C between
        # the two. Its record is the trial's result.
        status = "succeeded"
        metrics.update({**run.get("train_metrics", {}), **run.get("metrics", {}),
                        "step": run.get("steps"), "samples_per_s": run.get("samples_per_s"),
                        "wall_s": run.get("wall_s")})
    elif interrupted and not run and not metrics:
        status = "not started"  # drawn, waiting for room at the Ctrl-C
    elif interrupted and run.get("status") != "failed":
        status = "interrupted"  # stopped by the user's Ctrl-C (its error, if any, is that)
    elif result.error is not None and run.get("status") != "stopped":
        status = "failed"  # the trial raised: its run failed on its own
    else:
        # The scheduler ended it at its last reported step. Its run.json may say failed: Tune
        # removes a stopped trial's placement group while its actor winds down, which ends
        # the run's controller under it (an early stop, not a failure).
        status = "stopped early"
    workers = params.get("cluster.workers", metrics.get("workers", default_workers))
    error = None
    if status == "failed":
        error = (str(result.error).strip().splitlines()[-1] if result.error is not None
                 else str(run.get("error")))[:500]
    keep = {k: v for k, v in metrics.items() if k not in BOOKKEEPING and
            isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {
        "trial": path.name, "overrides": overrides, "status": status,
        "workers": int(workers), "steps": metrics.get("step"), "metrics": keep,
        "metric": None, "samples_per_s": metrics.get("samples_per_s"),
        "wall_s": metrics.get("wall_s") or metrics.get("time_total_s"),
        "restarts": metrics.get("restarts"), "error": error,
        "run_dir": str(path.parents[1] / path.name),
    }


def not_started(index: int) -> dict:
    return {"trial": f"(not started {index + 1})", "overrides": [], "status": "not started",
            "workers": None, "steps": None, "metrics": {}, "metric": None,
            "samples_per_s": None, "wall_s": None, "restarts": None, "error": None,
            "run_dir": None}


def summarize(conf: RayTuneSweeperConf, name: str, sweep_dir: Path, space: SweepSpace,
              rows: list[dict], at_once: int, budget: float, started: float) -> dict:
    for row in rows:
        # a figure every trial reports (samples_per_s, wall_s, steps) is a row's own
        row["metric"] = row["metrics"].get(conf.metric, row.get(conf.metric))
    done = [r for r in rows if r["status"] == "succeeded" and r["metric"] is not None
            and math.isfinite(r["metric"])]  # a NaN is never the best
    pick = max if conf.mode == "max" else min
    best = pick(done, key=lambda r: r["metric"]) if done else None
    return {"name": name, "dir": str(sweep_dir), "search": conf.search, "metric": conf.metric,
            "mode": conf.mode, "fixed_overrides": list(space.fixed), "max_concurrent": at_once,
            "cpu_budget": budget, "wall_s": round(time.time() - started, 1),
            "best": best, "trials": rows}


def print_summary(summary: dict, paths: dict, failed: list[dict]) -> None:
    counts: dict[str, int] = {}
    for r in summary["trials"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    log.info("sweep %s done in %.0fs: %s", summary["name"], summary["wall_s"],
             ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(paths["markdown"].read_text(), flush=True)
    for r in failed:
        print_error(f"trial {r['trial']} ({' '.join(r['overrides'])}) failed: {r['error']}")
    log.info("sweep record: %s", paths["json"])
