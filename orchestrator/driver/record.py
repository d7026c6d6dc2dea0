"""The run record (run.json): a plain object fed by events, serialised as
docs/run-record.md describes."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields

from orchestrator.driver.failure_policy import Verdict, WorkerError, classify
from orchestrator.redaction import REDACTED, redact
from orchestrator.strict_json import finite

__all__ = ["REDACTED", "RunRecord", "redact"]  # redact: the config's, before it is recorded

RECENT_EVALUATIONS = 100  # kept in run.json's "evaluations"


@dataclass
class RunRecord:
    run_name: str
    trainer: str
    config: dict
    checkpoint_uri: str
    status: str = "running"
    resumed_from_step: int | None = None
    world_sizes: list[dict] = field(default_factory=list)
    restarts: int = 0
    preemptions: int = 0
    checkpoints: list[dict] = field(default_factory=list)
    steps: int = 0
    total_steps: int | None = None
    lost_steps: int = 0
    samples: int = 0
    metrics: dict = field(default_factory=dict)
    train_metrics: dict = field(default_factory=dict)
    evaluation: dict | None = None  # the newest periodic evaluation: {"step", "metrics"}
    # The newest RECENT_EVALUATIONS of them, oldest first: a sweep's trial reads run.json
    # about once a second and reports each one to Tune, however many came in between.
    evaluations: list[dict] = field(default_factory=list)
    time_to_first_step_s: float | None = None
    wall_s: float | None = None
    # The one throughput figure (the progress line, run.json, a sweep's report): samples per
    # second of the current worker group from the end of its first reported step to its newest
    # one; start-up, restore and the first step's warm-up are left out.
    samples_per_s: float | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)  # the current group: rank, pid, node
    # worker exceptions, with the decision; a worker that told nothing (killed, cut off): what
    # Ray Train saw of it
    failures: list[dict] = field(default_factory=list)
    preemption_notices: list[dict] = field(default_factory=list)
    # Streamed data: shards, rows and bytes of the data, and the bytes each rank read (its
    # latest worker group's, from the step it started at).
    data: dict | None = None
    # A coordinating trainer's own processes (trainer=tf_ps: its workers and parameter
    # servers, closures rescheduled, how long each worker was away), as it last said.
    processes: dict | None = None
    permanent_error: str | None = None  # the traceback of a failure that repeated
    started_at: float = field(default_factory=time.time)
    _steady_from: tuple[float, int] | None = None  # (time, samples) at the group's first step
    _errors: list = field(default_factory=list)  # (worker group index, WorkerError)
    _failure_groups: list = field(default_factory=list)  # each failures entry's worker group
    _group: int = 0  # worker groups seen so far (the first worker of each one counts it)
    _group_of_pid: dict = field(default_factory=dict)  # worker pid -> its group
    _preempted_since_start: bool = False
    # The worker groups (by _group) Ray Train saw fail since the last start: a set, since its
    # controller tells it at every poll while a group's failure lasts (a preemption's 120 s).
    _failed_groups: set = field(default_factory=set)
    _permanent_step: int | None = None  # where the failure that repeated was raised
    _permanent_why: str = ""  # why it is not retried

    # -- events ------------------------------------------------------------------------
    def group_started(self, world_size: int, step: int, at: float,
                      total_steps: int | None = None) -> str:
        """Record a worker group's start; say why it started: start, preemption, restart, resize."""
        kind = "start"
        # Each failed group spent a restart, a shrink after a lost node included, and one
        # that failed before it announced itself (restoring, loading its data) too.
        failed, self._failed_groups = len(self._failed_groups), set()
        if self.world_sizes:
            # Every start after the first restarts from a checkpoint; the steps done past
            # that checkpoint are computed twice.
            self.lost_steps += max(0, self.steps - step)
            if self._preempted_since_start:
                self._preempted_since_start = False  # counted as a preemption, not a restart
                kind = "preemption"
            elif failed or world_size == self.world_sizes[-1]["size"]:
                self.restarts += max(failed, 1)
                kind = "restart"
            else:
                kind = "resize"  # grown into new room
        else:
            self.resumed_from_step = step if step > 0 else None
            if failed:  # the first group failed before it announced itself
                self.restarts += failed
                kind = "restart"
        self.world_sizes.append({"size": world_size, "step": step, "at_s": round(at - self.started_at, 3)})
        self.steps = step
        self.total_steps = total_steps or self.total_steps
        self._steady_from = None
        return kind

    def progress(self, step: int, samples: int, metrics: dict, at: float) -> None:
        if self.time_to_first_step_s is None:
            self.time_to_first_step_s = round(at - self.started_at, 3)
        self.steps = step
        self.samples += samples
        self.train_metrics = dict(metrics)
        if self._steady_from is None:
            self._steady_from = (at, self.samples)
            if self.world_sizes:  # when the group's first step ended (recovery time)
                self.world_sizes[-1]["first_step_at_s"] = round(at - self.started_at, 3)
        elif at > self._steady_from[0]:
            rate = (self.samples - self._steady_from[1]) / (at - self._steady_from[0])
            self.samples_per_s = round(rate, 1)

    def evaluated(self, step: int, metrics: dict) -> None:
        self.evaluation = {"step": step, "metrics": dict(metrics)}
        self.evaluations = [*self.evaluations, self.evaluation][-RECENT_EVALUATIONS:]

    def checkpoint(self, step: int, uri: str, nbytes: int, save_s: float, upload_s: float,
                   write_s: float = 0.0) -> None:
        """save_s: the step blocked; write_s: the upload waiting for files still being
        written in the background (a future from write); upload_s: from then to the commit."""
        self.checkpoints.append({"step": step, "uri": uri, "bytes": nbytes,
                                 "save_s": round(save_s, 4), "write_s": round(write_s, 4),
                                 "upload_s": round(upload_s, 4)})

    def checkpoint_found(self, step: int, uri: str, nbytes: int) -> bool:
        """A committed checkpoint a worker group resumes from: rank 0 tells the recorder of
        each commit without waiting, so a node lost right after committing can take that word
        with it. Listed in step order, its timings unknown. True if it was missing. Not the
        checkpoint the command itself started from: that one was committed before it."""
        if not self.world_sizes or step <= (self.resumed_from_step or 0):
            return False
        if any(c["step"] == step for c in self.checkpoints):
            return False
        entry = {"step": step, "uri": uri, "bytes": nbytes, "save_s": None, "write_s": None,
                 "upload_s": None, "found_at_resume": True}
        at = next((i for i, c in enumerate(self.checkpoints) if c["step"] > step),
                  len(self.checkpoints))
        self.checkpoints.insert(at, entry)
        return True

    def warning(self, message: str) -> None:
        self.warnings.append(message)

    def group_failed(self) -> None:
        """Ray Train saw the current worker group fail (it restarts one, or stops)."""
        self._failed_groups.add(self._group)

    def worker_started(self, rank: int, pid: int, node: str) -> bool:
        """True when this worker is the first of a new group."""
        new = not self.workers or any(w["rank"] == rank for w in self.workers)
        if new:
            self.workers = []  # the first worker, or a rank seen again: a new worker group
            self._group += 1
        self.workers = sorted([*self.workers, {"rank": rank, "pid": pid, "node": node}],
                              key=lambda w: w["rank"])
        self._group_of_pid[pid] = self._group
        return new

    def restored(self, rank: int, nbytes: int) -> None:
        """What a worker of the current group fetched of the checkpoint it resumed from: rank 0
        the whole one (it verifies it), the others what they load."""
        for worker in self.workers:
            if worker["rank"] == rank:
                worker["restored_bytes"] = nbytes

    def worker_error(self, error: WorkerError) -> Verdict:
        # One earlier error per worker group that failed alike: ranks of one group often fail
        # together, and a repeat is counted in attempts, not in ranks. A report can arrive
        # late: a worker cut off by a partition tells of its failure when the link comes back,
        # after its group was replaced; it is compared with the groups before its own.
        group = self._group_of_pid.get(error.pid, self._group)
        alike = {g: e for g, e in self._errors if g < group and e.same_failure(error)}
        verdict = classify(list(alike.values()), error)
        self._errors.append((group, error))
        self._add_failure(group, {"rank": error.rank, "step": error.step, "error": error.kind,
                                  "message": error.message, "decision": verdict.reason,
                                  "pid": error.pid})
        if verdict.permanent and self.permanent_error is None:  # the first one is the cause
            self.permanent_error = (f"worker rank {error.rank} at step {error.step}: "
                                    f"{error.kind}: {error.message}\n{error.traceback}")
            self._permanent_step = error.step
            self._permanent_why = ("the same error repeated after a restart" if error.retry
                                   else f"{error.kind} is not retried")
        return verdict

    def worker_lost(self, rank: int, message: str) -> None:
        """Ray Train saw a worker of the current group fail that told nothing itself: its
        process killed, its node cut off or gone. Replaced by the worker's own report if that
        arrives later (a partitioned worker's, once its link is back)."""
        kind, _, text = message.partition(": ")
        pid = next((w["pid"] for w in self.workers if w["rank"] == rank), None)
        self._add_failure(self._group, {
            "rank": rank, "step": self.steps, "error": kind, "message": text,
            "decision": "RETRY, since " + ("its node was preempted" if self._preempted_since_start
                                           else "the worker was lost and told nothing itself"),
            "pid": pid, "lost": True})

    def _add_failure(self, group: int, entry: dict) -> None:
        told = next((i for i, (g, f) in enumerate(zip(self._failure_groups, self.failures,
                                                      strict=True))
                     if g == group and f["rank"] == entry["rank"] and f.get("lost")), None)
        if told is None:
            self.failures.append(entry)
            self._failure_groups.append(group)
        elif not entry.get("lost"):
            self.failures[told] = entry  # the worker's own word on it

    def failure_line(self) -> str | None:
        """The failure that repeated, in one line (its traceback stays in permanent_error).
        One raised after the last training step (the evaluation, the final metrics) is not
        lost training: the line says which checkpoint holds it and what the same command does."""
        if self.permanent_error is None:
            return None
        cause = self.permanent_error.splitlines()[0]
        kept = max([c["step"] for c in self.checkpoints] + [self.resumed_from_step or 0])
        after_training = bool(self.total_steps) and (self._permanent_step or 0) >= self.total_steps
        if after_training and kept >= self.total_steps:
            return (f"the run failed after its last training step ({self._permanent_why}), "
                    f"{cause}; the checkpoint at step {kept} is committed: the same "
                    "command resumes there and only runs what comes after training (traceback: "
                    "run.json permanent_error)")
        return (f"training failed permanently ({self._permanent_why}), {cause} "
                "(traceback: run.json permanent_error)")

    def preemption_notice(self, step: int, deadline_s: float | None, nodes: list[str], at: float) -> None:
        self.preemptions += 1
        self._preempted_since_start = True
        self.preemption_notices.append({"step": step, "deadline_in_s": deadline_s,
                                        "nodes": nodes, "at_s": round(at - self.started_at, 3)})

    def worker_finished(self, step: int, metrics: dict, at: float) -> None:
        self.steps = step
        self.metrics = dict(metrics)

    def finish(self, status: str, error: str | None, at: float) -> None:
        self.status = status
        self.error = error
        self.wall_s = round(at - self.started_at, 3)
        if status == "failed":
            self._not_retried()

    def _not_retried(self) -> None:
        """A failed run's last worker group was not replaced: its failures judged worth a
        retry say they were not retried (RETRY read as if a restart had followed)."""
        if not self._failure_groups or len(self._failure_groups) != len(self.failures):
            return  # a record read back from run.json: the groups are not known
        last = max(self._failure_groups)
        allowed = (self.config.get("failure") or {}).get("max_restarts") \
            if isinstance(self.config, dict) else None
        why = (f"all {allowed} restarts of failure.max_restarts were used"
               if isinstance(allowed, int) and self.restarts >= allowed else "the run stopped")
        for entry, group in zip(self.failures, self._failure_groups, strict=True):
            if group == last and entry["decision"].startswith("RETRY, since "):
                new = entry["decision"].removeprefix("RETRY, since ")
                new = new.removesuffix(" is new") + ": new" if new.endswith(" is new") else new
                entry["decision"] = f"NOT RETRIED, since {why} ({new})"

    # -- output ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @classmethod
    def from_dict(cls, data: dict) -> RunRecord:
        """A record as run.json holds it (its public fields; keys it does not know left out)."""
        public = {f.name for f in fields(cls) if not f.name.startswith("_")}
        return cls(**{k: v for k, v in data.items() if k in public})

    def write(self, path: str) -> None:
        tmp = f"{path}.tmp"
        # Errors, warnings and URIs can quote a secret (a URL's credentials, an AWS key): the
        # strings are hidden here; the config's secret keys were hidden when it was recorded.
        with open(tmp, "w") as f:
            json.dump(finite(redact(self.to_dict(), by_key=False)), f, indent=2, sort_keys=False,
                      default=str)  # a value of a user's own type (an Enum) as its text
            f.write("\n")
        os.replace(tmp, path)  # readers never see a half-written record
