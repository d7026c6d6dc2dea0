"""The driver: what `python -m orchestrator` does around Ray once the config is checked.

launch.py runs one job (run_plan.py decides its name, storage and start; ray_session.py starts
or joins Ray; recorder.py's actor keeps run.json; scaling.py and backends.py turn the config
into Ray Train's; placement_watch.py, interrupts.py and processes.py handle waiting, Ctrl-C
and leftovers; failure_policy.py decides what a worker's error means for the run).
"""
