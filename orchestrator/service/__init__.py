"""A service that keeps a command's Ray, its driver and its processes for the next commands
(cluster.keep_alive=SECONDS).

A short command spends most of its time starting processes: the driver's Python, Hydra and
torch, Ray's start, and a new process for each of the run's actors (recorder, Ray Train's
controller, the workers with torch imported). With
cluster.keep_alive, the first command starts a service (a detached process, one per user and
Python) that runs it; each later command with the key hands itself to the service (the
command line, folder, environment, umask and terminal: client.py) and the service runs it in
its own process, on the Ray it holds, where the processes the command's actors need were
started while it waited (orchestrator/ray_internals/ready_processes.py). A command that asks for
another Ray (cluster.address, cluster.num_cpus, Ray Train's knobs), a sweep, or one sent while
the service is busy runs on its own, as without the key. The service ends cluster.keep_alive
seconds after its last command, or with `python -m orchestrator.service stop`.
"""
