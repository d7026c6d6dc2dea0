"""Names of Ray's environment variables the orchestrator sets, which Ray reads but does not
promise to keep (no Ray import here: the driver's planning uses them too)."""

# The environment variables Ray Train's controller reads that the orchestrator sets (their
# names live only here; the backends' own, such as TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, are
# in orchestrator/driver/backends.py, and are checked alike).
WORKER_HEALTH_CHECK_TIMEOUT = "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"
HEALTH_CHECK_INTERVAL = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
WORKER_GROUP_START_TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # orchestrator/driver/scaling.py
# Ray Train's own preemption watcher (an actor a worker group): off where the orchestrator runs
# the same watcher as a thread of the controller (ray_internals/preemption_watch.py).
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Ray Train's state tracking, which fills the dashboard's Train page (read by fit() in the
# driver: cluster.dashboard_train_page).
STATE_TRACKING = "RAY_TRAIN_ENABLE_STATE_TRACKING"
ENV_KNOBS = (WORKER_HEALTH_CHECK_TIMEOUT, HEALTH_CHECK_INTERVAL, WORKER_GROUP_START_TIMEOUT,
             PREEMPTION_WATCHER, STATE_TRACKING)

# Ray core's: set by `python -m orchestrator` before Ray is imported (orchestrator/__main__.py).
AUTO_CONNECT = "RAY_ENABLE_AUTO_CONNECT"
# What a worker process runs as it starts ("module.function"): Ray's worker_process_setup_hook,
# which Ray turns into this variable for a job's runtime environment but not for an actor's;
# set on the training workers' (orchestrator/worker/warm.py).
SETUP_HOOK = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
CORE_KNOBS = (AUTO_CONNECT, SETUP_HOOK)

# Ray core's system config for a cluster the command starts itself (ray.init's _system_config;
# Ray refuses to start with a key it does not know). When the first driver connects, the
# raylet starts one idle worker process per CPU with no job and no runtime environment; every
# process of a run has one (Ray Train's knobs are the job's variables), so none could take
# those, and starting them cost ~0.7 CPU-s in the second the run's recorder and controller
# start their own (2 cores).
#
# The raylet's own plasma client connects to the store its other thread is still opening: the
# first try fails and it waits raylet_client_connect_timeout_milliseconds (1000) before the
# next, a whole second on ray.init's path whenever the store is the slower (the raylet's log:
# "Plasma store debug dump" then "ObjectManager server started" 1.00 s later, in 4 of 4 default
# commands and 2 of 5 quiet starts, scripts/bench_ray_start.py). 50 ms
# retries, as many more of them, keep Ray's 10 s budget for every other connection (a worker's
# to its raylet).
CONNECT_RETRY = {"raylet_client_connect_timeout_milliseconds": 50,
                 "raylet_client_num_connect_attempts": 200}
EMBEDDED_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, **CONNECT_RETRY}


def connect_retry_env() -> dict[str, str]:
    """CONNECT_RETRY for a raylet started by `ray start` (the tests' and scripts' clusters), as
    Ray core reads its config from the environment."""
    return {f"RAY_{key}": str(value) for key, value in CONNECT_RETRY.items()}

# Ray Train's controller takes a preemption notice without a deadline (a drain without
# --deadline-remaining-seconds) as one with this many seconds from when it saw it
# (DEFAULT_PREEMPTION_DEADLINE_S): the workers hold at least this long before they conclude the
# node stays (orchestrator/worker/loop.py), or their error is charged to failure.max_restarts.
NO_DEADLINE_PREEMPTION_S = 120.0
