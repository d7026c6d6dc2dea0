"""Everything the orchestrator takes from Ray that Ray does not promise to keep, in one place:

- cluster.py: Ray core's private state and token-auth helpers, its node's table of the
  processes it started (the autoscaler monitor, stopped before ray.shutdown(); a GCS or raylet
  that exited under a service), the file `ray start` records its address in, and Ray's own
  shutdown at the interpreter's exit (left out once a command killed the cluster it started);
- knobs.py: the names of Ray's environment variables the orchestrator sets, the deadline Ray
  Train gives a preemption notice without one, and the system
  config of a cluster a command starts itself;
- train_hooks.py: Ray Train's private trainer hooks (its default callbacks, its SIGINT
  handler, its controller's start) and the controller's settings made of knobs.py's
  environment variables;
- pg_cleaner.py: a sweep trial's placement groups, registered in Ray's internal key-value
  store for the sweep's driver to remove once their controller is dead (instead of Ray Train's
  cleaner, a process per trial);
- prestart.py: the raylet's PrestartWorkers call, for the processes kept ready for a restart;
- group_prestart.py: a run's first worker group's processes asked for as soon as its
  controller's has started, with the runtime environments Ray core will give them (its
  inheritance rule, rebuilt);
- ready_processes.py: a service's processes kept ready for its next command (Ray's private
  actor table, the idle processes of a job);
- process_starts.py: Ray's own process starts, closed to a thread whose Ray a command abandoned;
- head_start.py: an embedded head's dashboard started beside its raylet (Ray's node starts
  them in turn), with the address the command chose for it, at Ray's workers' priority and
  not waited for; its log monitor left out where nothing reads it, its autoscaler monitor
  where nothing can be autoscaled;
- dashboard_packages.py: whether the dashboard's packages are installed, asked of the file
  system (Ray's node imports them all, in the driver, to know);
- preemption_watch.py: Ray Train's preemption watcher, run as a thread of its controller
  instead of an actor process per worker group;
- controller_barrier.py (and barrier_handle.py, what the workers hold): Ray Train's
  synchronization barrier kept in its controller's process, instead of an actor process per
  worker group (its controller class swapped for a subclass that holds the barriers);
- failure_decisions.py: Ray Train's failure policy, made to stop at once on a worker error
  the run judged permanent (instead of starting one more worker group first);
- scaling.py: Ray Train's fixed-size scaling policy without autoscaler requests (an embedded
  cluster has no autoscaler);
- torch_backend.py: Ray Train's torch backend, its worker-side functions called without torch
  in the controller's process;
- tensorflow_backend.py: Ray Train's TensorFlow backend, without tensorflow in the driver's
  and the controller's processes;
- fork_server/: a sweep's worker processes forked from a server with its imports done (the
  runtime environment's `py_executable` as its client; the job id and raylet pid Ray's C++
  config reads at import; Ray's ID generator, which must not be seeded before a fork: the
  actor class IDs Ray Train's and Ray Data's modules draw at import come from os.urandom).

tests/test_ray_internals.py checks each against the installed Ray (not a stand-in), so a
Ray upgrade that renames one fails there, naming it.
"""
