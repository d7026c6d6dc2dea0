"""Everything the orchestrator takes from Ray that Ray does not promise to keep, in one place.

Each hook is one of two kinds. [correctness]: a feature needs it (Ctrl-C finishing the record,
permanent errors not retried, an abandoned session's exit, secrets kept off the dashboard);
it installs on any Ray, and one a Ray upgrade took away is a warning in run.json. [speed]: it
only saves start-up time; on a Ray or torch outside the tested range (versions.py) the speed
hooks the driver chooses are off (launch.py, fork_server.usable()).

- versions.py [correctness]: the tested ranges of Ray and torch (pyproject.toml's), the line a
  command says outside them, and the switch of the speed hooks;
- cluster.py [correctness]: Ray core's private state and token-auth helpers (a joining driver
  on Ray 2.58-2.60), its node's table of the processes it started (a GCS or raylet that exited
  under a service; [speed]: the autoscaler monitor stopped before ray.shutdown()), the file
  `ray start` records its address in, and Ray's own shutdown at the interpreter's exit (left
  out once a command killed the cluster it started, its driver threads' deaths quiet);
- entrypoint.py [correctness]: the command line the dashboard shows, with its secrets redacted;
- knobs.py: the names of Ray's environment variables the orchestrator sets ([correctness]: the
  controller's hang and preemption timeouts; [speed]: its polling), the deadline Ray Train
  gives a preemption notice without one, and the system config of a cluster a command starts
  itself ([speed]);
- train_hooks.py: Ray Train's private trainer hooks: its SIGINT handler ([correctness]), its
  controller's start (permanent errors, elastic multiples: [correctness]), its default
  callbacks and autoscaling requests ([speed]), and the controller's settings made of
  knobs.py's environment variables;
- failure_decisions.py [correctness]: Ray Train's failure policy, made to stop at once on a
  worker error the run judged permanent (instead of starting one more worker group first);
- process_starts.py [correctness]: Ray's own process starts, closed to a thread whose Ray a
  command abandoned (no process outlives it; [speed]: the dashboard's start reniced);
- pg_cleaner.py [speed]: a sweep trial's placement groups, registered in Ray's internal
  key-value store for the sweep's driver to remove once their controller is dead (instead of
  Ray Train's cleaner, a process per trial);
- prestart.py [speed]: the raylet's PrestartWorkers call, for the processes kept ready for a
  restart;
- group_prestart.py [speed]: a run's first worker group's processes asked for as soon as its
  controller's has started, with the runtime environments Ray core will give them (its
  inheritance rule, rebuilt);
- ready_processes.py [speed]: a service's processes kept ready for its next command (Ray's
  private actor table, the idle processes of a job);
- head_start.py [speed]: an embedded head's dashboard started beside its raylet (Ray's node
  starts them in turn), at Ray's workers' priority and not waited for; its log monitor left
  out where nothing reads it, its autoscaler monitor where nothing can be autoscaled
  ([correctness]: the dashboard's port, the free one the command held for it);
- dashboard_packages.py [speed]: whether the dashboard's packages are installed, asked of the
  file system (Ray's node imports them all, in the driver, to know);
- preemption_watch.py [speed]: Ray Train's preemption watcher, run as a thread of its
  controller instead of an actor process per worker group;
- controller_barrier.py (and barrier_handle.py, what the workers hold) [speed]: Ray Train's
  synchronization barrier kept in its controller's process, instead of an actor process per
  worker group (its controller class swapped for a subclass that holds the barriers);
  [correctness]: the controller started with room for every rank's call at once (Ray starts
  an async actor with room for 1,000: a larger run hung at its first collective);
- preemption_agreement.py [speed, at scale] (and check_answers.py, in the controller): the
  workers' agreement on a preemption notice with one call per node into the run's controller
  (rank 0's notice, read where the watcher marked it, with its proposal; each node's ranks read
  it from a folder on the node), instead of two barriers of one call per rank (Ray's public
  calls);
- scaling.py [speed]: Ray Train's fixed-size scaling policy without autoscaler requests (an
  embedded cluster has no autoscaler);
- torch_backend.py [speed]: Ray Train's torch backend, its worker-side functions called
  without torch in the controller's process;
- torch_imports.py [speed]: torch's compiler front end (torch._dynamo, which torch imports
  with the first optimizer) imported ahead in a PyTorch worker's process and a sweep's fork
  server (off a restart's recovery where a process was kept ready);
- train_page.py [speed]: Ray Train's state callback (the dashboard's Train page), whose
  question to rank 0 "which framework versions" is answered in plain strings (torch's own
  pickles as its class, and unpickling it imported torch in the controller);
- tensorflow_backend.py [speed]: Ray Train's TensorFlow backend, without tensorflow in the
  driver's and the controller's processes (and its import's lines off the console);
- fork_server/ [speed]: a sweep's worker processes forked from a server with its imports done
  (the runtime environment's `py_executable` as its client; the job id and raylet pid Ray's
  C++ config reads at import; Ray's ID generator, which must not be seeded before a fork: the
  actor class IDs Ray Train's and Ray Data's modules draw at import come from os.urandom).

tests/test_ray_internals.py checks each against the installed Ray (not a stand-in), so a
Ray upgrade that renames one fails there, naming it.
"""
