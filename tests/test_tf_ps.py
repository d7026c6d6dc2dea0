"""trainer=tf_ps: TensorFlow's ParameterServerStrategy with its workers and parameter servers
as Ray actors, on real Ray: a lost worker does not stop training (no restart, it comes back at
its address), a lost parameter server restarts the run from its checkpoint; bad input is one
line before Ray starts."""

from __future__ import annotations

import os
import signal

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.cli import CONF_DIR
from orchestrator.errors import ConfigError
from tests.conftest import finish_run, start_run
from tests.conftest import wait_for as waited

# A fault-free run of these settings (2 workers, 1 parameter server) ended at test_loss
# 0.23 after 600 steps (measured 2026-11-29); predicting the mean gives ~20 (the target's
# variance). A run that lost a server must get below this again.
CONVERGED = 1.0


def refused(*overrides: str) -> str:
    from orchestrator.driver.launch import checked_run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        node = compose("config", overrides=["trainer=tf_ps", *overrides])
    with pytest.raises(ConfigError) as caught:
        checked_run(node)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_input_is_one_line_naming_the_key_before_ray_starts():
    assert refused("trainer.ps=0").startswith(
        "trainer.ps=0 is not allowed: an integer >= 1 (the parameter servers")
    assert refused("cluster.workers=0").startswith("cluster.workers=0 is not allowed")
    assert refused("cluster.min_workers=1", "cluster.workers=2").startswith(
        "cluster.min_workers=1 is not allowed with trainer=tf_ps")
    # The model is built and run on two rows on the driver (in a process of its own)
    assert refused("trainer.model.hidden=[x]").startswith(
        "trainer.model._target_='trainers.mwms.models.mlp' did not build: ")
    assert refused("trainer.model._target_=torch.nn.Identity", "~trainer.model.hidden") == (
        "trainer.model._target_='torch.nn.Identity' gave a torch.nn.modules.linear.Identity, not "
        "a tf.keras.Model: build it with tf.keras (import tensorflow as tf; "
        "tf.keras.Sequential(...)), not Keras 3's `import keras`")


def pids_of(rec: dict, job: str) -> list[int]:
    return [m["pid"] for m in rec["processes"][job]]


def test_a_lost_worker_is_rescheduled_around_and_a_lost_parameter_server_restarts_from_the_checkpoint(
        ray_head, tmp_path):
    """2 workers and a parameter server learn a regression with a user's Keras model. Worker 1
    SIGKILLed: the coordinator (the run's one Ray Train worker) goes on in the same process, its
    closures go to worker 0, steps go on while it is away, and it comes back at its address.
    Then the parameter server SIGKILLed: its variables are gone, the run restarts from the
    newest checkpoint (steps from the saved iterations) and learns on."""
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, f"cluster.address={ray_head.address}", "trainer=tf_ps",
                     f"storage.uri={tmp_path / 'ckpt'}",
                     "cluster.workers=2", "trainer.ps=1", "data=synthetic", "data.task=regression",
                     "data.rows=4000", "trainer.model._target_=tests.user_models.tiny_keras_model",
                     "~trainer.model.hidden", "+trainer.model.width=32", "trainer.lr=0.01",
                     "trainer.epochs=100000", "run.eval_every_steps=100",
                     "checkpoint.every_steps=200", "failure.max_restarts=3")

    def wait_for(predicate):  # the run's record, once it says so (or the run's end, failing)
        def ready(r):
            assert proc.poll() is None, finish_run(proc, run_dir).output[-3000:]
            return r.get("processes") and predicate(r)
        return waited(ready, run_dir)

    rec = wait_for(lambda r: r.get("steps", 0) >= 100)
    coordinator = rec["processes"]["coordinator_pid"]
    # (a restart before this, a connection to the servers that hung at the start, is not
    # what is tested: the restarts are counted from here)
    restarts = rec["restarts"]
    lost = pids_of(rec, "workers")[1]
    os.kill(lost, signal.SIGKILL)

    def back(r):
        worker = r["processes"]["workers"][1]
        return worker["restarts"] == 1 and worker["here"] and worker["away"]
    rec = wait_for(back)
    facts = rec["processes"]
    away = facts["workers"][1]["away"][0]
    assert facts["coordinator_pid"] == coordinator and rec["restarts"] == restarts
    assert [w["pid"] for w in rec["workers"]] == [coordinator]  # Ray Train's one worker
    assert pids_of(rec, "workers")[1] != lost
    assert away["to_step"] > away["from_step"], away  # worker 0 went on alone
    assert facts["rescheduled_closures"] >= 1, facts
    # It learns on with both: an evaluation after its return below the threshold
    rec = wait_for(lambda r: any(e["step"] > away["to_step"] + 100 and
                                 e["metrics"]["test_loss"] < CONVERGED
                                 for e in r["evaluations"]))
    assert rec["restarts"] == restarts and rec["processes"]["coordinator_pid"] == coordinator

    saved = rec["checkpoints"][-1]["step"]
    os.kill(pids_of(rec, "ps")[0], signal.SIGKILL)
    rec = wait_for(lambda r: r["restarts"] == restarts + 1 and len(r["world_sizes"]) == restarts + 2
                   and r["processes"]["coordinator_pid"] != coordinator)
    resumed = rec["world_sizes"][-1]["step"]
    assert resumed >= saved and resumed in [c["step"] for c in rec["checkpoints"]]
    assert any(f["error"] == "ServerLost" and "parameter server 0" in f["message"]
               for f in rec["failures"]), rec["failures"]
    rec = wait_for(lambda r: any(e["step"] > resumed + 100 and
                                 e["metrics"]["test_loss"] < CONVERGED
                                 for e in r["evaluations"]))
    proc.send_signal(signal.SIGINT)
    result = finish_run(proc, run_dir)
    assert result.returncode == 130, result.output[-3000:]
    assert result.record["status"] == "interrupted"
    # A quiet console: no TensorFlow start-up lines (the driver's trial of the model runs in
    # a process of its own), no rescheduling noise (run.json counts it)
    assert "absl::InitializeLog" not in result.output and "failed with" not in result.output
    # Its workers counted as the user asked for them, not Ray Train's one coordinator
    assert "2 workers, 1 parameter server started, training from step 0" in result.output


def test_the_rescheduling_tensorflow_logs_is_counted_per_worker_and_kept_off_the_console():
    import logging

    from trainers.tf_ps.servers import Member, ReschedulingCounter

    workers = [Member("worker", i, None, f"h:{i}") for i in range(2)]
    counter = ReschedulingCounter([*workers, Member("ps", 0, None, "h:9")])
    # TensorFlow's coordinator's words for a closure it puts back (cluster_coordinator.py)
    failed = logging.LogRecord("tensorflow", logging.ERROR, "", 0, "Worker %s failed with %r:%s",
                               ("/job:worker/replica:0/task:1", OSError(), "Socket closed"), None)
    other = logging.LogRecord("tensorflow", logging.ERROR, "", 0, "something else", (), None)
    assert counter.filter(failed) is False and counter.filter(other) is True
    assert [w.rescheduled for w in workers] == [0, 1] and counter.seen.is_set()


def test_a_coordinator_is_one_ray_train_worker_and_its_workers_share_the_cpus():
    from orchestrator.config.schema import ClusterConfig
    from orchestrator.driver.scaling import coordinated_cluster, coordinator_scaling, scaling_kwargs
    from trainers.tf_ps.train import cpus_each

    cluster = ClusterConfig(workers=4)
    scaling = coordinator_scaling(scaling_kwargs(cluster, 2.0))
    assert scaling["num_workers"] == 1 and scaling["resources_per_worker"] == {"CPU": 0.01}
    given = coordinated_cluster(cluster, 2.0)
    assert given["workers"] == 4 and cpus_each(given, 5) == 0.39  # 4 workers + 1 server, beside the coordinator
    assert cpus_each({**given, "cpus_per_worker": 0.25}, 5) == 0.25
