"""Test hosts on one machine, each with its own network and its own disks (Linux, as root).

Host i gets a network namespace with its own address (10.77.<tag>.1i on a bridge, no route
anywhere else), its own hostname (resolving to that address), and a mount namespace with a
private /tmp and a private "local disk" mounted at the same path on every host
(``<root>/local``), plus a directory every host bind-mounts at ``<root>/shared`` (what NFS or
a shared volume is on a real cluster). Host 1 runs the Ray head (and the driver, and SeaweedFS
for ``storage=s3``), the others ``ray start --address``.

    python scripts/local_hosts.py up --hosts 3     # start, print the addresses, Ctrl-C stops
    python scripts/local_hosts.py down --tag 3     # remove what instance 3 left, by name
    python scripts/local_hosts.py down --all       # ... of every instance (other checkouts' too)

Everything belongs to names of our own: namespaces ``orh<tag>h<i>``, bridge ``orh<tag>br``,
veths ``orh<tag>v<i>``, files under ``/var/tmp/orchestrator-test-hosts/orh<tag>`` (a base
folder only its owner may enter, checked before use: /var/tmp is everyone's). Every process a
host runs lives in its network namespace, so stopping a host kills exactly the pids
``ip netns pids`` lists there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.ray_internals.knobs import connect_retry_env
from scripts.local_cluster import NO_FIRST_JOB_PRESTART, NO_LOG_MONITOR  # the same settings

PREFIX = "orh"
ROOT_BASE = Path("/var/tmp/orchestrator-test-hosts")
RAY = str(Path(sys.executable).with_name("ray"))
REPO = Path(__file__).resolve().parent.parent


def seen_under_tmp() -> list[Path]:
    """The repository and the Python environment, relative to /tmp, where they lie under it."""
    found = []
    for path in sorted({REPO, Path(sys.prefix).resolve()}):
        try:
            rel = path.relative_to("/tmp")
        except ValueError:
            continue
        if not any(rel.is_relative_to(other) for other in found):
            found.append(rel)
    return found
RAY_PORT = 6379
DASHBOARD_PORT = 8265
# start_ray(health=...) sets the head's node health check, in Ray's own names (RAY_<name> in
# the head's environment). Ray's defaults (health_check_period_ms=3000, _timeout_ms=10000,
# _failure_threshold=5) declared a cut-off node dead after 63-64 s here.


def private_base() -> Path:
    """ROOT_BASE, made if absent (mode 0700), and refused unless it is a real folder of this
    user's that nobody else may write: another local user could otherwise have put a link or
    a folder of theirs there for root to write through."""
    try:
        ROOT_BASE.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(ROOT_BASE)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise RuntimeError(f"{ROOT_BASE} is not a folder of this user's that only it may write: "
                           "remove it")
    return ROOT_BASE


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def node_env(extra: dict | None = None) -> dict:
    """`ray start --address` and drivers use token auth exactly when the head does (Ray 2.60
    turns it on for a head when ~/.ray/auth_token exists, not for a node joining it). Every
    host runs this checkout, as every node of a real cluster has the package installed."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    if (Path.home() / ".ray" / "auth_token").exists():
        env["RAY_AUTH_MODE"] = "token"
    env.update(connect_retry_env())  # a second less in every raylet's start
    env.update(extra or {})
    return env


@dataclass
class Host:
    index: int  # 1-based; host 1 is the head
    netns: str
    veth: str
    ip: str
    dir: Path  # this host's own files: tmp/ (its /tmp), local/ (its local disk)
    holder: subprocess.Popen | None = None  # keeps the mount namespace alive
    ray: subprocess.Popen | None = None  # `ray start --block`
    ray_log: Path | None = None  # its output
    partitioned: bool = False

    @property
    def name(self) -> str:
        return f"h{self.index}"


@dataclass
class LocalHosts:
    """N test hosts; use as a context manager (everything is removed on exit)."""

    count: int = 3
    tag: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    hosts: list[Host] = field(default_factory=list)

    # -- naming ------------------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.tag}br"

    @property
    def root(self) -> Path:
        return ROOT_BASE / f"{PREFIX}{self.tag}"

    @property
    def local_disk(self) -> Path:
        """The same path on every host, a different disk behind it on each."""
        return self.root / "local"

    @property
    def shared(self) -> Path:
        """The same directory on every host (each bind-mounts <root>/nfs there). From this
        machine's own namespace, reach it through host_path (<root>/nfs)."""
        return self.root / "shared"

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    def host_path(self, host: int, inside: str | Path) -> Path:
        """Where a path seen inside a host (its /tmp, its local disk, the shared mount) lies
        in this process's own namespace."""
        inside = Path(inside)
        h = self.hosts[host - 1]
        for mount, backing in ((Path("/tmp"), h.dir / "tmp"), (self.local_disk, h.dir / "local"),
                               (self.shared, self.root / "nfs")):
            if inside == mount or mount in inside.parents:
                return backing / inside.relative_to(mount)
        return inside

    # -- start -------------------------------------------------------------------------
    def __enter__(self) -> LocalHosts:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> LocalHosts:
        t0 = time.time()
        self._claim_tag()
        (self.root / "nfs").mkdir()
        self.shared.mkdir()
        self.local_disk.mkdir()
        sh("ip", "addr", "add", f"10.77.{self.tag}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        names = "".join(f"10.77.{self.tag}.{10 + i} {PREFIX}{self.tag}h{i}\n"
                        for i in range(1, self.count + 1))
        (self.root / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        for i in range(1, self.count + 1):
            self.hosts.append(self._make_host(i))
        self.timings["namespaces_s"] = round(time.time() - t0, 2)
        return self

    def _claim_tag(self) -> None:
        """The first free tag: creating the bridge is the atomic claim."""
        tags = [self.tag] if self.tag is not None else range(1, 250)
        for tag in tags:
            if sh("ip", "link", "add", f"{PREFIX}{tag}br", "type", "bridge", check=False).returncode == 0:
                self.tag = tag
                private_base()
                shutil.rmtree(self.root, ignore_errors=True)  # a leftover of an earlier crash
                self.root.mkdir(mode=0o700)  # exclusive: fails if anything is still there
                return
        raise RuntimeError("no free test-host tag (run `python scripts/local_hosts.py down --all`)")

    def _make_host(self, i: int) -> Host:
        host = Host(i, f"{PREFIX}{self.tag}h{i}", f"{PREFIX}{self.tag}v{i}", f"10.77.{self.tag}.{10 + i}",
                    self.root / f"h{i}")
        for sub in ("tmp", "local"):
            (host.dir / sub).mkdir(parents=True)
        (host.dir / "tmp").chmod(0o1777)
        sh("ip", "netns", "add", host.netns)
        sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        sh("ip", "link", "set", host.veth, "master", self.bridge, "up")
        inside = ["ip", "netns", "exec", host.netns]
        sh(*inside, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
        sh(*inside, "ip", "link", "set", "eth0", "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        # Mount and UTS namespaces of its own, held open by `sleep`; commands join them with
        # nsenter. Its hostname resolves to its address, as on a real cluster (gloo and
        # torch.distributed advertise the address their hostname resolves to).
        # What lives under this machine's /tmp and every host must still see (a checkout and
        # its virtualenv in /tmp, as a CI clone may be) is bound into the host's own /tmp
        # first; --rbind carries those mounts along.
        q = shlex.quote
        keep = "".join(f"mkdir -p {q(str(host.dir / 'tmp' / rel))} && "
                       f"mount --bind {q(f'/tmp/{rel}')} {q(str(host.dir / 'tmp' / rel))} && "
                       for rel in seen_under_tmp())
        mounts = (f"hostname {q(host.netns)} && mount --bind {q(str(self.root / 'hosts'))} "
                  f"/etc/hosts && {keep}mount --rbind {q(str(host.dir / 'tmp'))} /tmp && "
                  f"mount --bind {q(str(host.dir / 'local'))} {q(str(self.local_disk))} && "
                  f"mount --bind {q(str(self.root / 'nfs'))} {q(str(self.shared))} && "
                  "echo ready && exec sleep infinity")
        host.holder = subprocess.Popen(
            [*inside, "unshare", "--mount", "--uts", "--propagation", "slave", "sh", "-c", mounts],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        line = host.holder.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"host {i}: mount namespace failed: {line} {host.holder.stdout.read()}")
        return host

    # -- running things on a host ------------------------------------------------------
    def command(self, host: int, cmd: list[str], cwd: str | Path | None = None) -> list[str]:
        h = self.hosts[host - 1]
        return ["nsenter", f"--target={h.holder.pid}", "--mount", "--uts", "--net",
                f"--wd={cwd or os.getcwd()}", "--", *cmd]

    def popen(self, host: int, cmd: list[str], cwd: str | Path | None = None,
              env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start a command inside host `host` (its network, its /tmp and local disk)."""
        return subprocess.Popen(self.command(host, cmd, cwd), env=node_env(env), **kwargs)

    def run(self, host: int, cmd: list[str], cwd: str | Path | None = None,
            env: dict | None = None, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, cmd, cwd), env=node_env(env), timeout=timeout,
                              capture_output=True, text=True, **kwargs)

    # -- Ray -----------------------------------------------------------------------------
    def start_ray(self, head_cpus: int = 0, node_cpus: int = 2,
                  health: dict[str, int] | None = None) -> LocalHosts:
        """The head on host 1, `ray start --address` on every other host, all at once."""
        t0 = time.time()
        self._started_with = (head_cpus, node_cpus, health)  # for restart_all
        self._health = {f"RAY_{k}": str(v) for k, v in (health or {}).items()}
        self._ray_start(self.head, head_cpus)
        self._wait_started(self.head)
        self.timings["ray_head_s"] = round(time.time() - t0, 2)
        self._node_cpus = node_cpus
        for h in self.hosts[1:]:
            self._ray_start(h, node_cpus)
        for h in self.hosts[1:]:
            self._wait_started(h)
        self.timings["ray_nodes_s"] = round(time.time() - t0 - self.timings["ray_head_s"], 2)
        return self

    def _ray_start(self, h: Host, cpus: int) -> None:
        common = ["--block", f"--node-ip-address={h.ip}", f"--num-cpus={cpus}",
                  "--object-store-memory=100000000", "--disable-usage-stats", *NO_LOG_MONITOR]
        if h.index == 1:
            args = ["--head", f"--port={RAY_PORT}", f"--dashboard-host={h.ip}",
                    f"--dashboard-port={DASHBOARD_PORT}", *NO_FIRST_JOB_PRESTART]
            env = self._health
        else:
            args, env = [f"--address={self.address}"], {}
        log = open(h.dir / f"ray-start-{time.time_ns()}.log", "w")
        h.ray = self.popen(h.index, [RAY, "start", *args, *common], env=env, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
        h.ray_log = Path(log.name)

    def _wait_started(self, h: Host, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while "block forever" not in h.ray_log.read_text():
            if h.ray.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray start on {h.name} failed: {h.ray_log.read_text()[-2000:]}")
            time.sleep(0.3)

    def restart_ray(self, host: int) -> None:
        """A new `ray start --address` on a host (after its raylet exited)."""
        h = self.hosts[host - 1]
        self.stop_ray(host)
        self._ray_start(h, self._node_cpus)
        self._wait_started(h)

    def restart_all(self) -> None:
        """Every link up and every host's Ray started anew as start_ray first did: what a test
        that failed midway left (a host cut off, a killed run's driver on the head) must not
        fail the next one."""
        for h in self.hosts:
            if h.partitioned:
                sh("ip", "netns", "exec", h.netns, "ip", "link", "set", "eth0", "up")
                h.partitioned = False
        self._stop_ray(self.hosts, timeout=10)
        self.start_ray(*self._started_with)

    def stop_ray(self, host: int, timeout: float = 30) -> None:
        self._stop_ray([self.hosts[host - 1]], timeout)

    def _stop_ray(self, hosts: list[Host], timeout: float) -> None:
        """SIGTERM makes `ray start --block` stop what it started (every host's at once, the
        same `timeout` for all of them); then SIGKILL the rest of each one's group."""
        hosts = [h for h in hosts if h.ray is not None]
        for h in hosts:
            if h.ray.poll() is None:
                h.ray.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout
        for h in hosts:
            try:
                h.ray.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for h in hosts:
            try:
                os.killpg(h.ray.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            h.ray.wait()
            h.ray = None

    # -- faults ------------------------------------------------------------------------
    def partition(self, host: int) -> None:
        """Cut a host off: its link goes down; its processes live on, unreachable."""
        h = self.hosts[host - 1]
        sh("ip", "netns", "exec", h.netns, "ip", "link", "set", "eth0", "down")
        h.partitioned = True

    def heal(self, host: int, rejoin_wait_s: float = 60) -> str:
        """The link comes back. A raylet the head has not declared dead carries on ('rejoined');
        one it declared dead exits by itself (Ray 2.60), and a new `ray start` joins in its
        place ('restarted'), as an operator or a node supervisor would do."""
        h = self.hosts[host - 1]
        sh("ip", "netns", "exec", h.netns, "ip", "link", "set", "eth0", "up")
        h.partitioned = False
        deadline = time.time() + rejoin_wait_s
        while time.time() < deadline:
            if self.node_state(h.ip) == "ALIVE" and h.ray is not None and h.ray.poll() is None:
                return "rejoined"
            if h.ray is None or h.ray.poll() is not None:
                break
            time.sleep(0.5)
        self.restart_ray(host)
        return "restarted"

    def kill_host(self, host: int) -> None:
        """The machine dies: every process on it is SIGKILLed (its namespaces stay, so that
        restart_ray can bring it back)."""
        h = self.hosts[host - 1]
        kill_namespace_processes(h.netns, spare={h.holder.pid})
        if h.ray is not None:
            h.ray.wait()
            h.ray = None

    def host_of(self, pid: int) -> int | None:
        """Which host a process runs on (by its network namespace)."""
        name = sh("ip", "netns", "identify", str(pid), check=False).stdout.strip()
        return next((h.index for h in self.hosts if h.netns == name), None)

    def node_state(self, ip: str) -> str | None:
        """ALIVE if a raylet at this address is alive as the head sees it, DEAD if every one
        that ever joined from it is dead (a host restarted before left dead ones behind)."""
        states = {n["state"] for n in self.nodes() if n["ip"] == ip}
        return "ALIVE" if "ALIVE" in states else ("DEAD" if states else None)

    def nodes(self) -> list[dict]:
        """The cluster's nodes as the head's GCS sees them (its state API, over the bridge)."""
        import urllib.request

        request = urllib.request.Request(
            f"http://{self.head.ip}:{DASHBOARD_PORT}/api/v0/nodes?limit=1000&detail=false")
        token = Path.home() / ".ray" / "auth_token"
        if token.exists():
            request.add_header("Authorization", f"Bearer {token.read_text().strip()}")
        with urllib.request.urlopen(request, timeout=30) as response:
            rows = json.loads(response.read())["data"]["result"]["result"]
        return [{"ip": n["node_ip"], "state": n["state"], "id": n["node_id"]} for n in rows]

    # -- stop ----------------------------------------------------------------------------
    def down(self) -> None:
        t0 = time.time()
        # 3 s for all hosts together: nothing on a test host is kept (one by one, each waited
        # up to 10 s).
        self._stop_ray(list(reversed(self.hosts)), timeout=3)
        if self.tag is not None:
            remove_instance(self.tag)
        for h in self.hosts:  # killed with the namespace's other processes: reap them
            if h.holder is not None:
                h.holder.wait(timeout=10)
        self.hosts = []
        self.timings["down_s"] = round(time.time() - t0, 2)


def netns_names() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_instance(tag: int) -> None:
    """Kill every process in the instance's namespaces, delete them, the bridge and its files."""
    mine = [n for n in netns_names() if re.fullmatch(rf"{PREFIX}{tag}h\d+", n)]
    for ns in mine:
        kill_namespace_processes(ns)
    # The veths by name: deleting a namespace frees its end of the pair only when the kernel's
    # deferred cleanup gets to it (measured: one still there a minute later, on a busy machine).
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        match = re.match(rf"^\d+: ({PREFIX}{tag}v\d+)[@:]", line)
        if match:
            sh("ip", "link", "del", match.group(1), check=False)
    for ns in mine:
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", f"{PREFIX}{tag}br", check=False)
    root = ROOT_BASE / f"{PREFIX}{tag}"
    if root.exists():
        shutil.rmtree(root, ignore_errors=True)


def kill_namespace_processes(ns: str, timeout: float = 5, spare: set[int] = frozenset()) -> None:
    """SIGKILL every process in a network namespace of ours (but `spare`), until none is left."""
    deadline = time.time() + timeout
    while True:
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()
                if int(p) not in spare]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.time() > deadline:
            raise RuntimeError(f"processes in {ns} survive SIGKILL: {pids}")
        time.sleep(0.1)


def leftovers(tag: int | None = None) -> dict[str, list[str]]:
    """What an instance (`tag`), or any instance, left behind: namespaces, links, files."""
    number = rf"{tag}" if tag is not None else r"\d+"
    pattern = re.compile(rf"{PREFIX}{number}(h|v|br)\d*")
    links = [line.split(":")[1].strip().split("@")[0]
             for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines()]
    return {"netns": [n for n in netns_names() if pattern.fullmatch(n)],
            "links": [link for link in links if pattern.fullmatch(link)],
            "dirs": [str(p) for p in ROOT_BASE.glob(f"{PREFIX}*")
                     if re.fullmatch(rf"{PREFIX}{number}", p.name)]}


def remove_all() -> dict[str, list[str]]:
    found = leftovers()
    tags = {int(re.match(rf"{PREFIX}(\d+)", name).group(1))
            for name in found["netns"] + found["links"] + [Path(d).name for d in found["dirs"]]}
    for tag in sorted(tags):
        remove_instance(tag)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start test hosts and Ray; Ctrl-C stops everything")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--node-cpus", type=int, default=2)
    down = sub.add_parser("down", help="remove what an instance left (by name)")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--tag", type=int, help="the instance's tag (orh<tag>...)")
    which.add_argument("--all", action="store_true",
                       help="every instance's, other checkouts' live ones included")
    args = parser.parse_args()
    if args.action == "down":
        if args.all:
            print(json.dumps({"removed": remove_all()}, indent=2))
        else:
            found = leftovers(args.tag)
            remove_instance(args.tag)
            print(json.dumps({"removed": found}, indent=2))
        return
    with LocalHosts(args.hosts) as hosts:
        hosts.start_ray(node_cpus=args.node_cpus)
        print(json.dumps({"ray_address": hosts.address,
                          "hosts": {h.name: {"ip": h.ip, "netns": h.netns} for h in hosts.hosts},
                          "shared": str(hosts.shared), "local_disk": str(hosts.local_disk),
                          "run_on_head": " ".join(hosts.command(1, ["CMD"])),
                          "timings": hosts.timings}, indent=2), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
