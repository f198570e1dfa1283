"""Storage in an S3-compatible object store (AWS S3, MinIO, Ceph RGW, ...), through the ``minio`` client.

Configuration comes only from environment variables (names in :data:`ENV_VARS`):

``EDL_S3_ENDPOINT``
    Endpoint URL with scheme, e.g. ``http://minio.minio:9000``; default ``https://s3.amazonaws.com``.
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` (optional)
    Static credentials. Without ``AWS_ACCESS_KEY_ID`` requests are anonymous.
``AWS_REGION``
    Signing region; default ``us-east-1``.
``EDL_STORAGE_RETRY_SECONDS``
    Retry budget, see :mod:`edl_argo.storage.retry`.

Every request goes through :func:`~edl_argo.storage.retry.call_with_retry`; the HTTP pool below minio has
socket timeouts well below the retry budget and no retries of its own. Transfers report their progress, so
an upload or download interrupted after progress gets the whole budget again, and a download continues
from the byte where it broke off (pinned to the object's ETag, so it never mixes two versions).

Object names map to keys below the URL's prefix. A name with an empty segment (``a//b``) keeps it: the key
``a//b`` reads that object, not ``a/b``. Errors are raised as StorageError messages that name the URL and
the endpoint, and for authentication failures the *names* of the variables to check, never their values.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import certifi
import urllib3
from minio import Minio
from minio.error import InvalidResponseError, MinioException, S3Error
from minio.helpers import check_bucket_name

from edl_argo.errors import ConfigError, StorageError
from edl_argo.log import get_logger
from edl_argo.storage.base import (
    ObjectChangedError,
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    check_range,
    normalize_key,
    normalize_prefix,
)
from edl_argo.storage.retry import (
    Progress,
    RetryBudgetExhausted,
    RetryPolicy,
    call_with_retry,
    describe_error,
    is_connection_error,
    socket_timeouts,
)

__all__ = ["ENDPOINT_ENV", "ENV_VARS", "S3Storage"]

log = get_logger(__name__)

T = TypeVar("T")

ENDPOINT_ENV = "EDL_S3_ENDPOINT"
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
REGION_ENV = "AWS_REGION"
#: Every environment variable S3Storage reads.
ENV_VARS = (ENDPOINT_ENV, ACCESS_KEY_ENV, SECRET_KEY_ENV, SESSION_TOKEN_ENV, REGION_ENV)

DEFAULT_ENDPOINT = "https://s3.amazonaws.com"
#: The domain of AWS S3's endpoints, whose bucket names are checked by AWS's rules.
AWS_DOMAIN = "amazonaws.com"
DEFAULT_REGION = "us-east-1"

#: Bytes read per chunk of a download (each chunk is progress for the retry budget).
READ_CHUNK = 1 << 20
#: Connections kept per host; data loaders read shards from several threads.
POOL_SIZE = 32

_DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)


def _endpoint_from_env() -> tuple[str, str, bool]:
    """``(endpoint URL for messages, host[:port] for minio, use TLS)``; ConfigError if malformed."""
    text = os.environ.get(ENDPOINT_ENV, "").strip() or DEFAULT_ENDPOINT
    if "@" in text:  # user:password@host -- do not echo the value, it holds a secret
        raise ConfigError(
            f"{ENDPOINT_ENV} must not contain credentials; set {ACCESS_KEY_ENV} and {SECRET_KEY_ENV}"
        )
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ConfigError(f"{ENDPOINT_ENV}={text!r} is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ConfigError(
            f"{ENDPOINT_ENV}={text!r} must be an http:// or https:// URL without a path, "
            "e.g. http://minio.minio:9000"
        )
    return f"{parts.scheme}://{parts.netloc}", parts.netloc, parts.scheme == "https"


def _etag(value: str | None) -> str:
    """An ETag as a version token (without the quotes some servers send)."""
    return (value or "").strip('"')


def _http_pool(policy: RetryPolicy) -> urllib3.PoolManager:
    """A pool with short timeouts and no retries or redirects of its own: :mod:`.retry` owns the budget."""
    connect, read = socket_timeouts(policy)
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=connect, read=read),
        maxsize=POOL_SIZE,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=False,
    )


class S3Storage(Storage):
    """Objects below ``s3://bucket/prefix``, configured from the environment (see the module docstring).

    Keys map to object names ``prefix/key``. The bucket must already exist. Construction validates the
    URL and the environment but makes no request.
    """

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise StorageError(f"invalid S3 URL {url!r}: expected s3://bucket/prefix")
        self.url = url
        self.bucket = parts.netloc
        self.endpoint, host, secure = _endpoint_from_env()
        # AWS addresses a bucket by a host name (s3://Bad_Bucket would fail in DNS): its names are checked by
        # its rules; another server (MinIO, Ceph) is addressed by path and may know older, laxer names.
        strict = host.split(":")[0].endswith(AWS_DOMAIN)
        try:
            check_bucket_name(self.bucket, strict=strict)
        except ValueError:
            rules = " (3 to 63 lowercase letters, digits, '.' and '-')" if strict else ""
            raise StorageError(
                f"invalid S3 URL {url!r}: {self.bucket!r} is not a valid bucket name{rules}"
            ) from None
        self.prefix = normalize_key(parts.path)
        self._policy = RetryPolicy.from_env()
        self._anonymous = not os.environ.get(ACCESS_KEY_ENV)
        self._uses_token = bool(os.environ.get(SESSION_TOKEN_ENV))
        self._client = Minio(
            host,
            access_key=os.environ.get(ACCESS_KEY_ENV) or None,
            secret_key=os.environ.get(SECRET_KEY_ENV, ""),
            session_token=os.environ.get(SESSION_TOKEN_ENV) or None,
            secure=secure,
            region=os.environ.get(REGION_ENV) or DEFAULT_REGION,
            http_client=_http_pool(self._policy),
        )

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r}, endpoint={self.endpoint!r})"

    # -- naming -----------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        """The object name of ``key`` (which must not be empty): its empty inner segments are kept."""
        normalize_key(key, allow_empty=False)  # the checks only: "a//b" names another object than "a/b"
        rel = key.strip("/")
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _key(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    # -- the one place that talks to minio ----------------------------------------------------------

    def _call(
        self,
        key: str,
        fn: Callable[[], T],
        policy: RetryPolicy | None = None,
        progress: Progress | None = None,
    ) -> T:
        """Run one idempotent request with retries and turn every failure into a StorageError."""
        url = self.describe(key)
        try:
            return call_with_retry(fn, url=url, policy=policy or self._policy, progress=progress)
        except RetryBudgetExhausted as exc:
            if is_connection_error(exc.last_error):
                raise StorageError(f"cannot reach S3 endpoint {self.endpoint}: {exc}") from exc.last_error
            raise StorageError(
                f"S3 endpoint {self.endpoint} kept failing for {url}: {exc}"
            ) from exc.last_error
        except S3Error as exc:
            raise self._s3_error(url, exc) from exc
        except InvalidResponseError as exc:
            raise StorageError(
                f"S3 endpoint {self.endpoint} answered a request for {url} with {describe_error(exc)} and "
                f"no S3 error document: is {ENDPOINT_ENV} the address of an S3 service?"
            ) from exc
        except (MinioException, urllib3.exceptions.HTTPError) as exc:
            raise StorageError(
                f"S3 request for {url} failed at endpoint {self.endpoint}: {describe_error(exc)}"
            ) from exc
        except OSError as exc:  # a local file being uploaded or downloaded
            raise StorageError(f"cannot access local file {exc.filename}: {exc.strerror or exc}") from exc

    def _s3_error(self, url: str, exc: S3Error) -> StorageError:
        if exc.code == "NoSuchBucket":
            return self._no_bucket()
        if exc.code == "NoSuchKey":
            return ObjectNotFoundError(f"no object at {url}")
        if exc.code == "PreconditionFailed":  # a resumed read's If-Match: the object was replaced meanwhile
            return ObjectChangedError(f"{url} changed while it was read")
        if exc.code in _DENIED_CODES:
            names = [ACCESS_KEY_ENV, SECRET_KEY_ENV] + ([SESSION_TOKEN_ENV] if self._uses_token else [])
            hint = f"check {', '.join(names[:-1])} and {names[-1]}"
            if self._anonymous:
                hint += f" ({ACCESS_KEY_ENV} is not set, so the request was anonymous)"
            return StorageError(f"access denied to {url}: {hint}")
        return StorageError(f"S3 error for {url} at endpoint {self.endpoint}: {describe_error(exc)}")

    def _no_bucket(self) -> StorageError:
        return StorageError(
            f"bucket {self.bucket!r} does not exist at endpoint {self.endpoint} "
            f"(from {self.url}; check the URL and {ENDPOINT_ENV})"
        )

    # -- Storage ----------------------------------------------------------------------------------

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._list(prefix)

    def _list(self, prefix: str, policy: RetryPolicy | None = None) -> list[ObjectInfo]:
        rel = normalize_prefix(prefix)
        name_prefix = f"{self.prefix}/{rel}" if self.prefix else rel

        def op() -> list[ObjectInfo]:
            objects = self._client.list_objects(self.bucket, prefix=name_prefix, recursive=True)
            found = []
            for o in objects:
                if not o.object_name or o.object_name.endswith("/"):  # skip "folder" placeholders
                    continue
                key = self._key(o.object_name)
                if key.startswith("/"):  # "prefix//x": no key below this root names it
                    log.warning("s3_object_skipped", bucket=self.bucket, object=o.object_name)
                    continue
                found.append(ObjectInfo(key, o.size or 0, _etag(o.etag)))
            return found

        return sorted(self._call(prefix, op, policy), key=lambda info: info.key)

    def stat(self, key: str) -> ObjectInfo:
        name = self._name(key)
        try:
            result = self._call(key, lambda: self._client.stat_object(self.bucket, name))
        except ObjectNotFoundError:
            # A HEAD response has no body, so a missing bucket looks like a missing key: tell them apart.
            if not self._call("", lambda: self._client.bucket_exists(self.bucket)):
                raise self._no_bucket() from None
            raise
        return ObjectInfo(key.strip("/"), result.size or 0, _etag(result.etag))

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._read(key, offset, length, None)

    def read_version(self, key: str, offset: int = 0, length: int | None = None, *, version: str) -> bytes:
        return self._read(key, offset, length, version)

    def _read(self, key: str, offset: int, length: int | None, version: str | None) -> bytes:
        """One ranged GET; with ``version``, ObjectChangedError unless the response's ETag is that one."""
        check_range(offset, length)
        if length == 0:
            found = self.stat(key)  # same errors as any read
            if version is not None:
                self._check_version(key, found.version, version)
            return b""
        name = self._name(key)
        chunks: list[bytes] = []
        progress = Progress()
        etag: list[str] = []  # of the first response: a resumed read must get the same object

        def op() -> bytes:
            done = sum(len(chunk) for chunk in chunks)
            if length is not None and done >= length:
                return b"".join(chunks)
            progress.begin(done)
            try:
                response = self._client.get_object(
                    self.bucket,
                    name,
                    offset=offset + done,
                    length=length - done if length is not None else 0,
                    request_headers={"If-Match": etag[0]} if etag else None,
                )
            except S3Error as exc:
                if exc.code == "InvalidRange":  # offset at or past the end
                    if version is not None and not chunks:
                        self._check_version(key, self.stat(key).version, version)
                    return b"".join(chunks)
                raise
            try:
                if not etag and response.headers.get("ETag"):
                    if version is not None:
                        self._check_version(key, _etag(response.headers["ETag"]), version)
                    etag.append(response.headers["ETag"])
                for chunk in response.stream(READ_CHUNK):
                    chunks.append(chunk)
                    progress.advance(len(chunk))
            finally:
                response.close()
                response.release_conn()
            return b"".join(chunks)

        return self._call(key, op, progress=progress)

    def write(self, key: str, data: bytes) -> None:
        name = self._name(key)
        progress = Progress()
        self._call(
            key,
            lambda: self._client.put_object(
                self.bucket, name, io.BytesIO(data), len(data), progress=progress
            ),
            progress=progress,
        )

    def write_file(self, key: str, path: Path) -> None:
        progress = Progress()
        upload = functools.partial(
            self._client.fput_object, self.bucket, self._name(key), str(path), progress=progress
        )
        self._call(key, upload, progress=progress)

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call(key, lambda: self._client.remove_object(self.bucket, name))

    def download(self, key: str, path: Path) -> None:
        progress = Progress()
        download = functools.partial(
            self._client.fget_object, self.bucket, self._name(key), str(path), progress=progress
        )
        self._call(key, download, progress=progress)
