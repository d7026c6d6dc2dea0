"""The worker side: what runs in every Ray Train worker, and the training function it runs.

training_function.py finds the user's (or a trainer's) function and checks it on the driver;
start.py says where each worker group starts (the spec, the checkpoint rank 0 chose);
loop.py runs the function with its WorkerContext (the public API, orchestrator/worker_api.py);
preemption_checks.py paces the ranks' agreement on preemption notices.
"""
