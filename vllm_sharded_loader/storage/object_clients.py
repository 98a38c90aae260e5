"""The obstore client of each bucket, built once per bucket and process from its cloud's usual settings.

Our only settings bound every request in time (``SHARDED_STATE_S3_*``). ``s3://``: ``boto3`` resolves
credentials, region and endpoint when installed (every usual AWS setting), else obstore reads
``AWS_*``. ``gs://``: Google's application default credentials, ``GOOGLE_*``, an emulator by
``STORAGE_EMULATOR_HOST``. ``az://`` or ``https://ACCOUNT.blob.core.windows.net/``: ``AZURE_STORAGE_*``
and ``AZURE_CLIENT_*``, or ``AZURE_STORAGE_CONNECTION_STRING``; Azurite by ``AZURE_STORAGE_USE_EMULATOR``.
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

AZURE_BLOB_HOST = ".blob.core.windows.net"

# The settings to check when a request fails, per URL scheme (a backend adds its own).
SETTINGS = {
    "s3": "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_PROFILE",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, GOOGLE_SERVICE_ACCOUNT, STORAGE_EMULATOR_HOST",
    "az": "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_CONNECTION_STRING, "
    "AZURE_STORAGE_USE_EMULATOR",
}

# Every request is bounded: timeouts, and retries with backoff bounded in count (AWS_MAX_ATTEMPTS) and
# time (seconds). Ten attempts back off over up to ~30 s: a store under load answers S3's retryable
# 500 InternalError for longer than a second.
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
    """obstore's ``client_options`` and ``retry_config`` for every store of ours."""
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


_runtime_pid: int | None = None  # the process that started obstore's I/O runtime


def check_not_forked(url: str) -> None:
    """Refuse in a fork of a process that had started obstore's I/O runtime.

    The runtime's threads do not survive ``fork()``: every request of the child would hang. Whatever
    reads object storage before vLLM forks its engine does it in a fresh process (:mod:`.fresh_process`).
    """
    if _runtime_pid is not None and _runtime_pid != os.getpid():
        raise Unsupported(
            f"{url}: this process (pid {os.getpid()}) was forked from pid {_runtime_pid} after that process "
            "had used object storage, whose I/O runtime does not survive a fork: a request would hang. "
            "Start this process fresh (for vLLM's workers: VLLM_WORKER_MULTIPROC_METHOD=spawn), or read "
            "object storage in the parent only from a fresh process."
        )


@functools.cache
def _store(scheme: str, bucket: str, account: str | None = None) -> Any:
    """The client of one bucket, configured from its cloud's usual settings."""
    _start_runtime()
    return CLIENTS[scheme](bucket, account)


@functools.cache
def _start_runtime() -> None:
    """Start obstore's I/O runtime from a thread that may run on every CPU, once per process.

    The runtime's I/O threads keep the CPU mask of the thread whose request made it, and vLLM pins a
    CPU worker's main thread to its cores: started there, all of a rank's socket reads share one core.
    """

    def start() -> None:
        from obstore.store import MemoryStore

        oscalls.use_every_cpu()
        with contextlib.suppress(Exception):  # any request starts it; this is the cheapest
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
    except ImportError:  # obstore reads AWS_* itself
        client_options, retry_config = client_settings(allow_http=True)
        return S3Store(bucket, client_options=client_options, retry_config=retry_config)
    from obstore.auth.boto3 import Boto3CredentialProvider

    core = botocore.session.get_session()
    session = boto3.Session(botocore_session=core)
    endpoint = _configured_s3_endpoint(core)
    config: dict[str, Any] = {"region": session.region_name or "us-east-1"}
    if endpoint is not None and not (urlparse(endpoint).hostname or "").endswith("amazonaws.com"):
        # MinIO, SeaweedFS, Ceph...: path-style requests.
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
    """The endpoint URL botocore would give an S3 client of session ``core``, or None for AWS's own.

    botocore's own lookup, without making a client (which loads S3's whole service model).
    """
    from botocore.configprovider import ConfiguredEndpointProvider

    if core.get_config_variable("ignore_configured_endpoint_urls"):
        return None
    provider = ConfiguredEndpointProvider(
        full_config=core.full_config, scoped_config=core.get_scoped_config(), client_name="s3"
    )
    return provider.provide()


# Google's clients' emulator variable (host:port or a URL); obstore's own is GOOGLE_BASE_URL.
GCS_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
GCS_CREDENTIAL_ENVS = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_BEARER_TOKEN",
)


def _gcs_store(bucket: str, account: str | None = None) -> Any:
    """obstore reads ``GOOGLE_*`` itself; an emulator is reached over HTTP with a placeholder token."""
    from obstore.store import GCSStore

    config: dict[str, Any] = {}
    emulator = os.environ.get(GCS_EMULATOR_ENV)
    if emulator:
        config["base_url"] = (emulator if "://" in emulator else f"http://{emulator}").rstrip("/")
        if not any(os.environ.get(name) for name in GCS_CREDENTIAL_ENVS):
            # Else obstore asks the GCE metadata server for a token before every write.
            config["bearer_token"] = "emulator"
    base_url = config.get("base_url") or os.environ.get("GOOGLE_BASE_URL", "")
    client_options, retry_config = client_settings(allow_http=base_url.startswith("http://"))
    return GCSStore(bucket, config=config, client_options=client_options, retry_config=retry_config)


AZURE_CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
_CONNECTION_STRING_FIELDS = {
    "accountname": "account_name",
    "accountkey": "account_key",
    "blobendpoint": "endpoint",
    "sharedaccesssignature": "sas_key",
}


def azure_connection_string(value: str) -> dict[str, Any]:
    """obstore's Azure settings from a connection string, which obstore does not read itself.

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
    """obstore reads ``AZURE_*`` itself; here a connection string, a URL's account, HTTP for an emulator."""
    from obstore.store import AzureStore

    connection = os.environ.get(AZURE_CONNECTION_STRING_ENV)
    config: dict[str, Any] = azure_connection_string(connection) if connection else {}
    if account is not None and account != config.get("account_name"):  # another account's string
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


# ``CLIENTS[scheme](bucket, account)`` (a backend adds its own).
CLIENTS: dict[str, Callable[[str, str | None], Any]] = {"s3": _s3_store, "gs": _gcs_store, "az": _azure_store}
