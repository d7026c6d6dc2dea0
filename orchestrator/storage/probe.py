"""Does every node see the checkpoint storage the driver sees? Asked of each node, not guessed.

On a cluster of several machines a directory is, most often, each machine's own disk: rank 0
would checkpoint wherever it runs, and a lost node, or rank 0 landing elsewhere, would lose
those checkpoints and start the run over without a word (Ray Train insists on shared storage
for this reason). So before any worker starts, the driver writes a probe file where the
checkpoints go and a Ray task pinned to each alive node reports whether it reads the same
bytes there. Object storage takes the same test: an endpoint the driver reaches at 127.0.0.1
is on no other node.

Nodes that join later are checked by every worker when it starts: the driver leaves a marker
in the run's folder (``.storage-marker``), and a worker that cannot read it stops the run with
that reason rather than writing checkpoints where no other node looks.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

import pyarrow.fs as pafs
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.errors import ConfigError, one_line
from orchestrator.storage.check import UNREACHABLE
from orchestrator.storage.location import StorageSpec, join, refused_credentials

if TYPE_CHECKING:
    from orchestrator.driver.run_plan import RunPlan

log = logging.getLogger("orchestrator")

PROBE_PREFIX = ".orchestrator-probe-"
MARKER = ".storage-marker"
ANSWER_TIMEOUT_S = 60.0  # a node still silent after this is checked when it runs a worker
INSTEAD = ("use storage=s3 with an endpoint every node reaches, or a directory mounted at the "
           "same path on every node (NFS, a shared volume)")


class StorageNotShared(RuntimeError):
    """A worker's node does not see the run's storage as the driver does."""


class StorageUnreachable(RuntimeError):
    """Nothing answers at the run's storage from a worker's node, for longer than an outage
    is waited out: a restart would meet the same, so the run stops with it."""

    retry = False


UNREACHABLE_WAIT_S = 120.0  # an outage at a worker's start is waited out this long
NOTHING_ANSWERS = "nothing answers at"
STORE_ERROR = "the store answered with an error:"  # a 503, a throttle: waited out like an outage


@dataclass(frozen=True)
class Probe:
    storage: StorageSpec
    path: str  # inside the storage's filesystem
    content: bytes


@dataclass(frozen=True)
class StorageMarker:
    """What a worker checks on its node before it trains (see check_worker_node)."""

    storage: StorageSpec  # the run's folder
    content: bytes


def _filesystem(spec: StorageSpec) -> tuple[pafs.FileSystem, str]:
    # A check, not a transfer: an endpoint that does not answer must not hold it for minutes.
    if spec.is_s3:
        return spec.filesystem(connect_timeout=3.0, request_timeout=10.0,
                               retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2))
    return spec.filesystem()


def probe_path(fs: pafs.FileSystem, path: str, name: str) -> str:
    """Where the probe goes. A directory store: in the nearest directory that exists (the
    check creates none); an object store: under the prefix (no directories to create)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return join(path, name)
    folder = PurePosixPath(path)
    while not os.path.isdir(folder) and folder != folder.parent:
        folder = folder.parent
    return str(folder / name)


def scrubbed(storage: StorageSpec, exc: BaseException) -> str:
    """An error's text without the storage's secrets."""
    return storage.credentials.scrub(str(exc)) if storage.credentials else str(exc)


def reads_back(storage: StorageSpec, path: str, content: bytes) -> str | None:
    """None if ``path`` holds ``content`` as seen from here, else why not (one short phrase)."""
    try:
        fs, _ = _filesystem(storage)
        with fs.open_input_stream(path) as f:
            found = f.read()
    except FileNotFoundError:
        return "no such file there"
    except OSError as exc:
        text = scrubbed(storage, exc)
        if any(marker in text for marker in UNREACHABLE):
            return f"{NOTHING_ANSWERS} {storage.endpoint or 'the S3 endpoint'}"
        first = (text.strip().splitlines() or [type(exc).__name__])[0][:160]
        # An object store that answers with an error (a 503, a throttle) is there: not a store
        # of the node's own. Not refused credentials or a missing bucket: waiting cures neither.
        lasting = refused_credentials(exc) or "NoSuchBucket" in text or "NOT_FOUND" in text
        return f"{STORE_ERROR} {first}" if storage.is_s3 and not lasting else first
    return None if found == content else "another file there (not the driver's)"


@ray.remote(num_cpus=0, max_retries=0)
def _node_reads_back(storage: StorageSpec, path: str, content: bytes) -> str | None:
    return reads_back(storage, path, content)


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def check_shared_storage(storage: StorageSpec, timeout_s: float = ANSWER_TIMEOUT_S,
                         shown_uri: str | None = None) -> None:
    """Raise ConfigError (exit 2) unless every alive node reads a probe the driver wrote under
    ``storage``; the probe is removed again whatever happens. One node: nothing to compare.
    ``shown_uri``: the URI the message names (storage.uri, not the run's folder under it)."""
    nodes = alive_nodes()
    if len(nodes) <= 1:
        return
    fs, root = _filesystem(storage)
    probe = Probe(storage, probe_path(fs, root, PROBE_PREFIX + secrets.token_hex(8)),
                  f"written by the driver on {socket.gethostname()}".encode())
    try:
        with fs.open_output_stream(probe.path) as f:
            f.write(probe.content)
    except OSError as exc:
        raise ConfigError(f"storage.uri={shown_uri or storage.uri!r}: cannot write there "
                          f"({one_line(scrubbed(storage, exc))[:200]})") from None
    try:
        answers = ask_nodes(nodes, probe, timeout_s)
    finally:
        try:
            fs.delete_file(probe.path)
        except OSError as exc:
            log.warning("could not remove the storage probe %s: %s", probe.path, exc)
    judge(storage, len(nodes), answers, shown_uri)


def ask_nodes(nodes: list[dict], probe: Probe, timeout_s: float) -> dict[str, str | None]:
    """{node address: None (sees it) | why not | 'no answer'} from a task pinned to each node."""
    refs = {}
    for node in nodes:
        strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        ref = _node_reads_back.options(scheduling_strategy=strategy).remote(
            probe.storage, probe.path, probe.content)
        refs[ref] = node["NodeManagerAddress"]
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    answers: dict[str, str | None] = {}
    for ref in ready:
        try:
            answers[refs[ref]] = ray.get(ref)
        except Exception as exc:  # the node died under the task: it will not run workers
            answers[refs[ref]] = f"no answer ({type(exc).__name__})"
    for ref in pending:
        ray.cancel(ref, force=True)
        answers[refs[ref]] = "no answer"
    return answers


def judge(storage: StorageSpec, count: int, answers: dict[str, str | None],
          shown_uri: str | None = None) -> None:
    """A pure decision over the nodes' answers: refuse if any node reads something else."""
    silent = sorted(a for a, why in answers.items() if why and why.startswith("no answer"))
    blind = {a: why for a, why in answers.items() if why and a not in silent}
    if silent:
        log.warning("storage check: node(s) %s did not answer; they are checked when they run "
                    "a worker", ", ".join(silent))
    if not blind:
        return
    where = ", ".join(f"{a}: {why}" for a, why in sorted(blind.items()))
    if storage.is_s3 and all(why.startswith("nothing answers") for why in blind.values()):
        raise ConfigError(f"storage.endpoint={storage.endpoint!r} is not reachable from "
                          f"{len(blind)} of {count} nodes ({where}): the workers on them could "
                          f"not checkpoint; give an address every node reaches (not a loopback one)")
    raise ConfigError(
        f"storage.uri={shown_uri or storage.uri!r} is not shared by the cluster's nodes: a "
        f"probe the driver wrote there is not seen on {len(blind)} of {count} nodes ({where}); "
        f"each node would keep its own checkpoints and the run would start over when rank 0 "
        f"moves: {INSTEAD}")


# -- nodes that join later: checked by each worker ------------------------------------------

def leave_marker(run_storage: StorageSpec, shown_uri: str | None = None) -> StorageMarker:
    """Written by the driver once every check passed (the run starts now); each worker reads
    it back on its own node. A store that refuses the write (full, failing, read-only) is one
    line before any worker starts, as for the probe: the run could not checkpoint there."""
    fs, root = _filesystem(run_storage)
    marker = StorageMarker(run_storage, f"run storage marker {secrets.token_hex(8)}".encode())
    try:
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(join(root, MARKER)) as f:
            f.write(marker.content)
    except OSError as exc:
        raise ConfigError(f"storage.uri={shown_uri or run_storage.uri!r}: cannot write there "
                          f"({one_line(scrubbed(run_storage, exc))[:200]})") from None
    return marker


def check_worker_node(marker: StorageMarker | None) -> None:
    """On a worker: raise StorageNotShared unless this node reads the driver's marker."""
    if marker is None:
        return
    fs, root = _filesystem(marker.storage)
    path = join(root, MARKER)
    why = reads_back(marker.storage, path, marker.content)
    deadline = time.monotonic() + UNREACHABLE_WAIT_S
    transient = (NOTHING_ANSWERS, STORE_ERROR)
    while why is not None and why.startswith(transient) and time.monotonic() < deadline:
        time.sleep(2.0)  # the store down (a restart during an outage), not a node of its own
        why = reads_back(marker.storage, path, marker.content)
    if why is not None:
        node = ray.util.get_node_ip_address()
        if why.startswith(transient):
            raise StorageUnreachable(
                f"the run's storage {marker.storage.uri} cannot be reached from node {node} "
                f"({why}, for {UNREACHABLE_WAIT_S:.0f} s): the run does not start over without "
                "it; fix the network or the store and run the same command again")
        raise StorageNotShared(
            f"node {node} does not see the run's storage {marker.storage.uri} as the driver "
            f"does (the driver's marker: {why}); it joined after the driver's check, and its "
            f"checkpoints would be invisible to the other nodes: {INSTEAD}")


def check_cluster_storage(plan: RunPlan, joined: bool) -> StorageMarker | None:
    """The driver's side, before any worker starts: on a joined cluster, check that every node
    sees the run's storage; on any, leave the marker (the run's first write: a folder that
    cannot be made or written, `storage.uri=/proc/x` say, is one line now, not a failure at the
    first checkpoint). ConfigError when either fails; a bucket the plan created for this run is
    removed again then. The marker, for workers to check their node, on a joined cluster (an
    embedded Ray is this machine alone)."""
    # The messages name storage.uri: the run's folder is storage.uri/<run.name>.
    shown_uri = plan.run_storage.uri.rsplit("/", 1)[0]
    try:
        if joined:
            check_shared_storage(plan.run_storage, shown_uri=shown_uri)
        marker = leave_marker(plan.run_storage, shown_uri=shown_uri)
    except ConfigError:
        if plan.created_bucket:
            remove_created_bucket(plan.run_storage)
        raise
    return marker if joined else None


def remove_created_bucket(storage: StorageSpec) -> None:
    try:
        fs, _ = storage.filesystem(allow_bucket_deletion=True)
        fs.delete_dir(storage.bucket)
    except OSError as exc:
        log.warning("could not remove the bucket %s created for this run: %s", storage.bucket, exc)
