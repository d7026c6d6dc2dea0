"""A plain command's Ray session, started beside the checks of the user's parts.

The CLI checks every config before Hydra starts the run (orchestrator/config/preflight.py);
for one run the costly check is the trial of the user's parts (building them, a tiny step:
~1-2 s), while Ray's start (~4 s on 2 cores) mostly waits for its processes. So Ray starts in
a background thread once the config and the training function passed their checks, just
before that trial, and the launch takes that session (scripts/bench.py fixed_cost: a cold
command 16.1 s vs 19.4 s, with the torch-free controller;
results/2026-11-26-fixed_cost-early-start.json). A check that fails still prints its
line at once; the command then kills what Ray started and exits 2 (~0.5 s later than it
did). A sweep starts its own session (orchestrator/sweep/runner.py), after checking every
trial; a command that only shows its config starts none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from orchestrator.config.schema import ClusterConfig, Config
from orchestrator.driver.backends import Backend, backend_named
from orchestrator.driver.ray_session import RaySession
from orchestrator.driver.scaling import elastic_controller_env
from orchestrator.errors import ConfigError
from orchestrator.ray_internals.train_hooks import controller_env

_early: tuple[tuple, RaySession] | None = None  # (what it was started with, the session)


@dataclass
class Held:
    """A service's session (orchestrator/service/): the first command's stays open, and every
    later command it serves must ask for the same Ray."""

    settings: dict = field(default_factory=dict)  # what the session was opened with
    session: RaySession | None = None
    folder: str | None = None  # the folder of the command being served


_held: Held | None = None


class OtherSettings(Exception):
    """A served command asks for a Ray other than the one the service holds."""


def hold_sessions() -> Held:
    """From now on this process's sessions stay open (a service's)."""
    global _held
    _held = Held()
    return _held


def served_folder() -> str | None:
    """The folder of the command a service is running (its workers start there; Hydra may
    have moved this process into the run's output folder since), else None."""
    return _held.folder if _held is not None else None


def session_settings(cluster: ClusterConfig, env: dict[str, str], verbose: bool) -> dict:
    """What a session is opened with, by key: the cluster keys Ray's start reads, and Ray
    Train's knobs (set once for the job: orchestrator/ray_internals/train_hooks.py). Not
    cluster.dashboard_port: a port asked for is only where a new dashboard would go, and a
    served command names the held one."""
    return {"cluster.address": cluster.address, "cluster.num_cpus": cluster.num_cpus,
            "cluster.dashboard": cluster.dashboard, "log.ray_verbose": verbose,
            "Ray Train's knobs (failure.hang_timeout_s, cluster.min_workers, "
            "trainer's backend)": env}


def shown(value) -> str:
    """A value as the command line writes it."""
    return {None: "null", True: "true", False: "false"}.get(value, repr(value)) \
        if isinstance(value, (bool, type(None))) else repr(value)


def check_held(settings: dict) -> bool:
    """Whether a service already holds a session for these settings (OtherSettings if it holds
    one for others)."""
    if _held is None or _held.session is None:
        return False
    differ = [f"{k}={shown(v)} (the service's: {shown(_held.settings[k])})"
              for k, v in settings.items() if _held.settings[k] != v]
    if differ:
        raise OtherSettings("; ".join(differ))
    return True


def session_env(cfg: Config, backend: Backend) -> dict[str, str]:
    """The environment of the run's Ray Train processes: Ray Train's knobs for its controller.
    An elastic job gives up on a placement group Ray's stale view promised after the hang
    timeout, not 60 s (orchestrator/driver/scaling.py: a partitioned node's CPUs look free)."""
    return {**controller_env(cfg.failure.hang_timeout_s, backend),
            **elastic_controller_env(cfg.cluster, cfg.failure.hang_timeout_s)}


def worker_forks(cfg: Config, backend: Backend) -> tuple[str, ...]:
    """What the training workers' fork server imports (orchestrator/ray_internals/fork_server/)
    for a run on a joined cluster, or () where they start as Ray starts them: on an embedded
    cluster (its first group's processes start ahead instead, ray_internals/group_prestart.py:
    a server beside them made the first step later there), on GPUs (a framework imported before
    Ray places a worker sees every GPU), for an elastic run (nodes of other machines join it),
    for a service's command (its Ray outlives the command), for a framework without a fork list,
    and where something else decides how the job's processes start. A 2-worker run on a
    joined 2-CPU node had its first step 2-3 s sooner with it, on ~10% less CPU; a
    4-worker run 4-5 s sooner."""
    from orchestrator.ray_internals import fork_server

    if cfg.cluster.address is None or _held is not None or cfg.cluster.gpus_per_worker or \
            cfg.cluster.elastic or not backend.fork_imports or not fork_server.usable():
        return ()
    return backend.fork_imports


def start_early(cfg_node: DictConfig, cfg: Config) -> None:
    """Start the run's session in the background (the CLI, for a plain command)."""
    global _early
    try:
        backend = backend_named(str(cfg_node.trainer.get("backend", "torch")))
    except ConfigError:
        return  # said by the checks that follow
    args = (cfg.cluster, session_env(cfg, backend), cfg.log.ray_verbose)
    if check_held(session_settings(*args)):
        return  # a service's session serves it
    forks = worker_forks(cfg, backend)
    session = RaySession(*args, keep_open=_held is not None, defer_dashboard=True,
                         worker_forks=forks)
    session.start_in_background()
    _early = ((*args, forks), session)


def session_for(cluster: ClusterConfig, env: dict[str, str], verbose: bool,
                forks: tuple[str, ...] = ()) -> RaySession:
    """The session started early for these settings, else a new one (``with`` starts it)."""
    global _early
    early, _early = _early, None
    if check_held(session_settings(cluster, env, verbose)):
        return RaySession(cluster, env, verbose)  # the held one, reused
    session = None
    if early is not None:
        if early[0] == (cluster, env, verbose, forks):
            session = early[1]
        else:
            early[1].abandon()  # settings changed since (never seen): start as asked
    session = session or RaySession(cluster, env, verbose, keep_open=_held is not None,
                                    defer_dashboard=True, worker_forks=forks)
    if _held is not None:
        _held.settings, _held.session = session_settings(cluster, env, verbose), session
    return session


def abandon_early() -> bool:
    """The command ends before its run took the session (bad input, Ctrl-C): stop what Ray
    started; whether there was such a session."""
    global _early
    early, _early = _early, None
    if early is not None:
        early[1].abandon()
    return early is not None
