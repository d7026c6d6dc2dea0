"""Driver side of a run: plan, start Ray, run the trainer's workers, write the record."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from omegaconf import DictConfig, OmegaConf
from ray.exceptions import RayActorError
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from orchestrator.checkpoint.cleanup import remove_stale
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.config.paths import resolve_paths
from orchestrator.config.schema import Config
from orchestrator.config.typed import to_typed
from orchestrator.driver.backends import Backend, check_cluster
from orchestrator.driver.fault_reporter import FaultReporter
from orchestrator.driver.interrupts import DeferredInterrupt, interrupted_by, sigterm_as_ctrl_c
from orchestrator.driver.placement_watch import PlacementWatch
from orchestrator.driver.ray_session import RaySession, user_pythonpath
from orchestrator.driver.record import RunRecord, redact
from orchestrator.driver.recorder import start_recorder
from orchestrator.driver.run_plan import (
    FINISHED,
    RunPlan,
    complete_data,
    finished_record,
    make_plan,
)
from orchestrator.driver.scaling import (
    coordinated_cluster,
    coordinator_scaling,
    scaling_kwargs,
    unplaceable_here,
)
from orchestrator.driver.session_start import (
    served_folder,
    session_env,
    session_for,
    worker_forks,
)
from orchestrator.errors import ConfigError, one_line, print_error
from orchestrator.observe.logs import train_logging
from orchestrator.observe.progress import ProgressWatcher, make_display, metric_text
from orchestrator.observe.tracebacks import echoes_a_peer
from orchestrator.ray_internals.head_start import dashboard_may_start
from orchestrator.ray_internals.knobs import STATE_TRACKING
from orchestrator.ray_internals.train_hooks import (
    barrier_room,
    elastic_in_multiples,
    hooks_missing,
    interrupted_by_ctrl_c,
    with_barrier_in_controller,
    with_permanent_errors_raised,
    with_plain_framework_versions,
    with_workers_started_ahead,
    without_autoscaling_requests,
    without_unneeded_actors,
)
from orchestrator.ray_internals.versions import speed_hooks
from orchestrator.storage.location import credential_chain_env
from orchestrator.storage.probe import check_cluster_storage, remove_created_bucket
from orchestrator.tracking.for_run import checked_tracking, open_tracking, start_tracking
from orchestrator.worker.loop import train_loop_per_worker
from orchestrator.worker.start import WorkerSpec
from orchestrator.worker.training_function import (
    Training,
    check_training,
    cluster_keys_given,
    size_cluster,
)
from orchestrator.worker.warm import worker_runtime_env

log = logging.getLogger("orchestrator")


def input_error(exc: ConfigError) -> int:
    print_error(str(exc))
    return exc.exit_code


@dataclass(frozen=True)
class CheckedRun:
    """A command's config, checked (the preflight's answers: orchestrator/config/once.py)."""

    cfg: Config
    training: Training
    data: dict  # cfg.data as the training function gets it
    plan: RunPlan


def checked_run(cfg_node: DictConfig) -> CheckedRun:
    """Every input check a run makes before Ray starts; ConfigError (exit 2) on the first."""
    size_cluster(cfg_node, cluster_keys_given())
    cfg = to_typed(cfg_node)
    complete_data(cfg_node, cfg)
    data = OmegaConf.to_container(cfg_node.data, resolve=True)
    training = check_training(OmegaConf.to_container(cfg_node.trainer, resolve=True), data)
    check_cluster(training.backend, cfg.cluster.gpus_per_worker)
    refuse_what_never_fits_before_ray(cfg)
    tracking_problem = checked_tracking(cfg)
    if tracking_problem:  # tracking.required=false: said, and retried while the run trains
        log.warning("tracking.uri: %s; the run trains, its metrics wait for it", tracking_problem)
    return CheckedRun(cfg, training, data,
                      make_plan(cfg, training.config, data, training.info.streams,
                                training.info.run_label(training.config)
                                if training.info.run_label else None))


def launch(cfg_node: DictConfig, output_dir: Path, started_at: float) -> int:
    """Run one job; return its exit code (0 ok, 1 training failed, 2 bad input)."""
    resolve_paths(cfg_node, Path.cwd())  # a sweep's trial had them resolved by its driver
    interrupted_by[0] = "SIGINT"  # a service runs many commands in one process
    try:
        run = checked_run(cfg_node)
    except ConfigError as exc:
        return input_error(exc)
    cfg, record_path = run.cfg, output_dir / "run.json"
    if run.plan.finished is not None:
        return said_finished(run, record_path, started_at)
    winding_down = DeferredInterrupt()  # armed once fit() returns (orchestrator/driver/interrupts.py)
    storage_checked, final = False, None
    tracker = start_tracking(cfg.tracking, run.plan, trainer_name(run), cfg.data.name,
                             run_config(run, cfg_node), command_folder())
    try:
        # Started by the CLI beside its checks when it could (orchestrator/driver/session_start.py).
        env = session_env(cfg, run.training.backend)
        forks = worker_forks(cfg, run.training.backend)
        with session_for(cfg.cluster, env, cfg.log.ray_verbose, forks) as session:
            sigterm_as_ctrl_c()
            refuse_what_never_fits(cfg, session)
            # Shared storage (orchestrator/storage/probe.py): on a joined cluster every node
            # must see the checkpoints the driver sees (exit 2 before any worker otherwise);
            # the marker lets each worker check its own node, nodes joining later included.
            storage_checked = True  # its own refusal removes a bucket it finds created
            storage_marker = check_cluster_storage(run.plan, joined=session.joined)
            open_tracking(tracker, cfg.tracking)
            record, recorder = open_record(run, cfg_node, session, output_dir, started_at,
                                           tracker is not None)
            try:
                code, status, error = train(run, session, recorder, output_dir, storage_marker,
                                            winding_down, tracker)
                final = ray.get(recorder.finish.remote(status, error))
            except RayActorError as exc:  # the recorder itself (the controller's is fit()'s)
                code, final = 1, recorder_lost(exc, record_path, record)
    except ConfigError as exc:
        if run.plan.created_bucket and not storage_checked:  # Ray refused: nothing is written
            remove_created_bucket(run.plan.run_storage)
        return input_error(exc)
    finally:
        winding_down.disarm()
        end_tracking(tracker, final, record_path)
    summarize(final, record_path)
    if final["status"] == "succeeded":
        keep_finished(run, final)
    if in_a_jobs_temporary_copy():
        keep_record_with_checkpoints(run, final)
    if (winding_down.seen or session.interrupted) and code == 0:
        log.warning("interrupted while shutting down, after the run %s", final["status"])
        code = 130
    return code


def said_finished(run: CheckedRun, record_path: Path, started_at: float) -> int:
    """A finished run's command again, asking for nothing more: one line, no worker, and a
    run.json that says so (a sweep's trial reports the finished run's metrics from it)."""
    done = run.plan.finished
    metrics = metrics_line(done.get("metrics") or {})
    log.info("run %s finished at step %s on %s: %s; nothing to train (more trainer.epochs or "
             "max_steps go on from there; another run.name starts again)", run.plan.run_name,
             done.get("step"), done.get("finished_at", "?"), metrics or "no metrics")
    record = RunRecord(run.plan.run_name, done.get("trainer") or run.training.path, {},
                       run.plan.run_storage.uri, status="already_finished",
                       resumed_from_step=done.get("step"), steps=done.get("step") or 0,
                       total_steps=done.get("total_steps"), metrics=done.get("metrics") or {},
                       train_metrics=done.get("train_metrics") or {}, started_at=started_at)
    record.finish("already_finished", None, time.time())
    record.write(str(record_path))
    return 0


# Where `ray job submit --working-dir` runs its entrypoint: a copy Ray deletes with the job.
JOB_COPY_MARKER = "/runtime_resources/working_dir_files/"


def in_a_jobs_temporary_copy() -> bool:
    return JOB_COPY_MARKER in os.getcwd()


def keep_record_with_checkpoints(run: CheckedRun, final: dict) -> None:
    """A job's run.json would stay in Ray's temporary copy of its working folder: a copy goes
    beside the run's checkpoints (records/<start>.json), and its address is printed."""
    name = f"records/{time.strftime('%Y%m%d-%H%M%S', time.gmtime(final.get('started_at') or time.time()))}.json"
    try:
        CheckpointStore(run.plan.run_storage).write_run_record(name, final)
    except OSError as exc:
        log.warning("the run record was not copied beside the checkpoints (%s)",
                    one_line(exc)[:200])
        return
    log.info("run record: %s/%s (this job's working folder is Ray's temporary copy)",
             run.plan.run_storage.uri.rstrip("/"), name)


def keep_finished(run: CheckedRun, final: dict) -> None:
    """finished.json beside the checkpoints: the same command again trains nothing."""
    try:
        record = finished_record(run.plan, run.cfg, run.training.config, run.data, final)
        CheckpointStore(run.plan.run_storage).write_run_record(FINISHED, record)
    except OSError as exc:  # the run succeeded all the same; a rerun resumes at its end
        log.warning("could not record that run %s finished (%s): the same command would "
                    "resume at its last checkpoint", run.plan.run_name, one_line(exc)[:200])


def refuse_what_never_fits_before_ray(cfg: Config) -> None:
    """refuse_what_never_fits for what is known before an embedded Ray has started: its CPUs
    (cluster.num_cpus, else this machine's) and custom resources (it has none). A busy machine
    slow to start Ray must not delay, or fail, the answer to bad input; GPUs are counted once
    Ray has looked."""
    cluster = cfg.cluster
    if cluster.address is not None or cluster.keep_alive:
        return
    cpus = float(cluster.num_cpus or os.cpu_count() or 1)
    per_worker = {name: each for name, each in
                  scaling_kwargs(cluster, cpus)["resources_per_worker"].items() if name != "GPU"}
    problem = unplaceable_here(cluster, per_worker, {"CPU": cpus})
    if problem:
        raise ConfigError(problem)


def refuse_what_never_fits(cfg: Config, session: RaySession) -> None:
    """An embedded cluster is this machine's one node: workers asking for more than it has
    would wait cluster.placement_timeout_s for room that never comes. Exit 2 instead, before
    any actor starts."""
    if session.joined:
        return
    per_worker = scaling_kwargs(cfg.cluster, session.total_cpus())["resources_per_worker"]
    problem = unplaceable_here(cfg.cluster, per_worker, ray.cluster_resources())
    if problem:
        raise ConfigError(problem)


def open_record(run: CheckedRun, cfg_node: DictConfig, session: RaySession, output_dir: Path,
                started_at: float, tracked: bool = False):
    """Say where everything is, and start the run's recorder actor (run.json, TensorBoard,
    metrics): (the record as the run begins, the recorder)."""
    cfg, plan = run.cfg, run.plan
    record_path = output_dir / "run.json"
    tensorboard_dir = output_dir / "tensorboard" if cfg.log.tensorboard else None
    if session.dashboard_url:
        log.info("Ray dashboard: %s (%s)", session.dashboard_url, session.dashboard_token_hint())
    metrics_url = session.metrics_url() if cfg.log.metrics else None
    if metrics_url:
        log.info("metrics: %s (orchestrator_* series, Prometheus format)", metrics_url)
    where = f"resuming at step {plan.resume_step}" if plan.resume_step else "from scratch"
    log.info("run %s: %s, checkpoints in %s", plan.run_name, where, plan.run_storage.uri)
    log.info("run record: %s", record_path)
    if tensorboard_dir:
        log.info("TensorBoard: tensorboard --logdir %s", tensorboard_dir)
    record = RunRecord(plan.run_name, trainer_name(run), run_config(run, cfg_node),
                       plan.run_storage.uri, started_at=started_at)
    return record, start_recorder(str(record_path), record,
                                  str(tensorboard_dir) if tensorboard_dir else None,
                                  cfg.log.metrics, tracked)


def trainer_name(run: CheckedRun) -> str:
    return run.training.config.get("name") or run.training.path


def run_config(run: CheckedRun, cfg_node: DictConfig) -> dict:
    """The run's config as run.json and the tracking server have it: resolved, redacted."""
    return redact({**OmegaConf.to_container(cfg_node, resolve=True),
                   "trainer": run.training.config})


def end_tracking(tracker, final: dict | None, record_path: Path) -> None:
    """The MLflow run ends as the run did, with run.json; a command that ended before
    training (exit 2 after the start) leaves none behind."""
    if tracker is None:
        return
    if final is None:
        tracker.cancel()
        return
    metrics = {f"eval/{k}": v for k, v in (final.get("metrics") or {}).items()
               if isinstance(v, (int, float))}
    tracker.add([(final.get("steps") or 0, time.time(), metrics, {})])
    tracker.finish(final["status"], [str(record_path)])


def recorder_lost(exc: Exception, record_path: Path, record: RunRecord) -> dict:
    """The recorder actor died (its node lost, or the cluster took the driver for dead): one
    line, and run.json finished from what the recorder last wrote (else the driver's copy)."""
    error = f"the run's recorder ended: {actor_death(exc)}"
    print_error(error)
    try:
        record = RunRecord.from_dict(json.loads(record_path.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # nothing (readable) written yet: the record as the run began
    record.finish("failed", error, time.time())
    record.write(str(record_path))
    return record.to_dict()


def train(run: CheckedRun, session: RaySession, recorder, output_dir: Path, storage_marker,
          winding_down: DeferredInterrupt, tracker=None) -> tuple[int, str, str | None]:
    """Ray Train's fit() with the progress display and the placement watch: (exit code,
    status, error)."""
    cfg = run.cfg
    scaling_args = scaling_kwargs(cfg.cluster, session.total_cpus())
    coordinated = None
    if run.training.info.coordinates:  # it starts its workers itself (trainer=tf_ps)
        scaling_args = coordinator_scaling(scaling_args)
        coordinated = coordinated_cluster(cfg.cluster, session.total_cpus())
    log.info("asking Ray for %s", describe_workers(scaling_args))
    # The dashboard's Train page: fit() reads Ray Train's switch in this process (a service
    # runs many commands in one: set either way).
    os.environ[STATE_TRACKING] = "1" if cfg.cluster.dashboard_train_page else "0"
    barrier_in_controller = speed_hooks("barrier") and with_barrier_in_controller()
    ray_trainer = ray_trainer_for(run, ScalingConfig(**scaling_args), recorder, output_dir,
                                  storage_marker,
                                  spares=not session.outlives_run and speed_hooks("spares"),
                                  coordinated=coordinated,
                                  py_executable=session.worker_py_executable,
                                  # the preemption agreement names the group by its barrier
                                  node_agreement=barrier_in_controller and speed_hooks("agreement"))
    # A sweep's trial, a service's command (a job that outlives the run) keeps the cleaner:
    # an early-stopped trial's workers must give their CPUs back to the next trials.
    # On the Ray and torch they were tested on, each unless switched off (ray_internals/versions.py).
    if speed_hooks("callbacks"):
        without_unneeded_actors(ray_trainer, keep_cleaner=session.outlives_run)
    if cfg.cluster.dashboard_train_page and speed_hooks("page_versions"):
        with_plain_framework_versions(ray_trainer)
    if not session.joined and not cfg.cluster.elastic:  # no autoscaler, nothing to grow into
        if speed_hooks("autoscaling"):
            without_autoscaling_requests(ray_trainer)
        if not session.outlives_run and speed_hooks("started_ahead"):  # a job that ends with the run
            with_workers_started_ahead(ray_trainer, barrier_in_controller)
    if cfg.cluster.elastic and cfg.cluster.workers_multiple_of > 1:
        elastic_in_multiples(ray_trainer, cfg.cluster.workers_multiple_of)
    with_permanent_errors_raised(ray_trainer, recorder)
    controller = interrupted_by_ctrl_c(ray_trainer)
    for problem in hooks_missing(ray_trainer, speed_hooks()) + \
            barrier_room(cfg.cluster.workers, barrier_in_controller):
        log.warning("%s", problem)
        recorder.warning.remote(problem)
    display = make_display(cfg.log.progress, run.training.info.step_unit, cfg.log.progress_every_s)
    watch = PlacementWatch(lambda: ray.get(recorder.waiting_s.remote(), timeout=30),
                           cfg.cluster.placement_timeout_s, describe_workers(scaling_args),
                           controller.stop)
    with ProgressWatcher(snapshots(recorder, tracker), display), watch:
        code, status, error = run_to_end(ray_trainer, winding_down, bool(run.plan.resume_step),
                                         recorder)
    if watch.reason:
        code, status, error = 1, "failed", watch.reason
    permanent = ray.get(recorder.failure_line.remote())  # its traceback: run.json
    if permanent:
        code, status, error = 1, "failed", permanent
        print_error(permanent)
    elif code == 1 and status != "stopped":
        print_error(error)
    if code == 0:  # every write is done: what failed ones left goes (a failed run's at its resume)
        remove_stale(CheckpointStore(run.plan.run_storage))
    return code, status, error


def ray_trainer_for(run: CheckedRun, scaling: ScalingConfig, recorder, output_dir: Path,
                    storage_marker, spares: bool, coordinated: dict | None = None,
                    py_executable: str | None = None,
                    node_agreement: bool = False) -> DataParallelTrainer:
    cfg, plan, training = run.cfg, run.plan, run.training
    given = {"trainer": training.config, "data": run.data}
    if coordinated is not None:
        given["cluster"] = coordinated
    spec = WorkerSpec(training.path, given,
                      cfg.data, cfg.checkpoint, plan.run_storage, plan.resume_source,
                      cfg.seed, recorder, cfg.failure.preemption_check_s,
                      cfg.failure.hang_timeout_s, eval_every_steps=cfg.run.eval_every_steps,
                      stream=plan.stream, run_name=plan.run_name,
                      max_restarts=cfg.failure.max_restarts,
                      # A sweep's trials keep no process for a restart (orchestrator/worker/spare.py).
                      spare_after_s=cfg.failure.spare_after_s if spares else None,
                      code_dir=served_folder() or command_folder(), data_files=plan.data_files,
                      node_agreement=node_agreement)
    run_config = RunConfig(
        name=plan.run_name,  # the run's name on the dashboard's Train page
        # A folder of its own for each fit(): Ray Train restores what it finds under a name
        # it ran before (the same command again in the same output folder)
        storage_path=str(output_dir / "ray_train" / uuid.uuid4().hex[:6]),
        failure_config=FailureConfig(max_failures=cfg.failure.max_restarts,
                                     max_preemption_failures=cfg.failure.max_preemptions),
        # On GPUs the framework is imported once the worker is placed: its CUDA start must see
        # only the GPUs Ray gives that worker (orchestrator/worker/warm.py).
        worker_runtime_env=worker_runtime_env(
            worker_env(training.backend),
            () if cfg.cluster.gpus_per_worker else training.warm_imports,
            scaling.resources_per_worker.get("CPU", 1), py_executable),
        logging_config=train_logging(cfg.log.ray_verbose),
        callbacks=[FaultReporter(recorder)],
    )
    return DataParallelTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec, "storage_marker": storage_marker},
        backend_config=training.backend.ray_config(cfg.failure.hang_timeout_s,
                                                   cfg.cluster.gpus_per_worker > 0),
        scaling_config=scaling,
        run_config=run_config,
    )


def snapshots(recorder, tracker=None):
    """The progress display's poll; it hands the tracker what the recorder has for it."""
    tracked_from = [0] if tracker is not None else [None]

    def poll(cursor: int):
        state = ray.get(recorder.snapshot.remote(cursor, tracked_from[0]), timeout=30)
        if state.world_size:  # the workers have started: a deferred dashboard may (head_start.py)
            dashboard_may_start()
        if tracker is not None:
            tracker.add(state.tracked)
            tracked_from[0] = state.tracked_cursor
        return state

    return poll


def describe_workers(scaling: dict) -> str:
    """`{'CPU': 0.5} * 4 workers`, or `* 2..8 workers (elastic)`."""
    n = scaling["num_workers"]
    count = f"{n[0]}..{n[1]} workers (elastic)" if isinstance(n, tuple) else f"{n} workers"
    return f"{scaling['resources_per_worker']} * {count}"


def command_folder() -> str:
    """The folder the command ran in: its workers on this node start there, as torchrun's
    would, so a relative path in a user's own keyword (+data.train.path=files/x.pt) is found.
    Hydra keeps it for a sweep's trial, which runs in Tune's folder."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return str(HydraConfig.get().runtime.cwd)
    except ValueError:  # no Hydra run (a test calling launch directly)
        return os.getcwd()


def worker_env(backend: Backend) -> dict[str, str]:
    """The backend's variables, the user's own PYTHONPATH, and where the AWS credential chain
    looks, so that each worker reads (and refreshes) the credentials itself
    (orchestrator/storage/location.py: CHAIN_ENV).

    Not the command's directory: Ray puts it first on every process's sys.path once the
    process is up (the job's py_driver_sys_path), as `python -m` does for the driver, so a
    user's own modules (trainer.model._target_=mypkg.Net) import on the workers. On PYTHONPATH
    it would also come first while Python starts, and a file of the user's named like a module
    Python imports then (re.py, types.py, enum.py) would kill every worker process at its start.
    """
    from orchestrator.service.served_env import for_workers

    # A served command's own variables too: the service's Ray has its first command's.
    return {**for_workers(), **user_pythonpath(), **credential_chain_env(), **backend.worker_env}


def run_to_end(ray_trainer, winding_down: DeferredInterrupt, resumed: bool,
               recorder) -> tuple[int, str, str | None]:
    """fit(), and what it ended with: (exit code, run.json status, error). From its return on,
    a Ctrl-C no longer interrupts (winding_down)."""
    from ray.train import TrainingFailedError

    try:
        ray_trainer.fit()
    except TrainingFailedError as exc:
        return 1, "failed", f"training failed: {describe_failure(exc)}"
    except KeyboardInterrupt:
        winding_down.arm()
        log.warning("interrupted; %s", kept_for_a_resume(recorder, resumed))
        return 130, "interrupted", f"interrupted ({interrupted_by[0]})"
    except RayActorError as exc:  # the controller died (or the placement watch stopped it)
        if GROUP_REMOVED in str(exc):
            # A sweep's trial that its scheduler stopped: Tune removes the trial's placement
            # group, the controller's, while the trial winds down. Not a failure.
            return 1, "stopped", "stopped early by the sweep's scheduler"
        return 1, "failed", f"Ray Train's controller ended: {actor_death(exc)}"
    finally:
        winding_down.arm()
    return 0, "succeeded", None


GROUP_REMOVED = "its placement group was removed"  # Ray's words for an actor it destroyed so


def kept_for_a_resume(recorder, resumed: bool) -> str:
    """What a resume of an interrupted run would start from, in words that match what exists."""
    try:
        checkpoints = ray.get(recorder.snapshot_checkpoints.remote(), timeout=10)
    except Exception:
        checkpoints = None
    if checkpoints:
        return (f"the newest committed checkpoint (step {checkpoints[-1]}) is kept for a resume:"
                " the same command resumes from it")
    if resumed:
        return "no checkpoint was committed in this run; the one it resumed from is kept"
    return "no checkpoint was committed yet: the same command starts from step 0"


def actor_death(exc: Exception) -> str:
    """Ray's many-line ActorDiedError in one line: what died, and Ray's reason (its last line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return " ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else type(exc).__name__


def describe_failure(exc: Exception) -> str:
    """The failure that says why: a rank that died or raised before one whose collective only
    lost it (rank 1 OOM-killed, rank 0's all-reduce then "Connection reset by peer")."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank, err = min(failures.items(), key=lambda item: (
            echoes_a_peer(str(item[1])), item[0]))
        return f"worker rank {rank}: {type(err).__name__}: {str(err).strip().splitlines()[-1]}"
    return str(exc).strip().splitlines()[-1]


def metrics_line(metrics: dict) -> str:
    return " ".join(f"{k}={metric_text(v, '.4f')}" for k, v in metrics.items())


def summarize(final: dict, record_path: Path) -> None:
    metrics = metrics_line(final.get("metrics", {}))
    log.info("%s in %.1fs at step %s: %s", final["status"], final.get("wall_s") or 0.0,
             final.get("steps"), metrics or "no metrics")
    log.info("run record: %s", record_path)
