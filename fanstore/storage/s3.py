"""The S3 backend: an ``s3://bucket/prefix`` location through s3fs (aiobotocore).

Configuration follows the standard AWS environment (``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``,
``AWS_SHARED_CREDENTIALS_FILE``), then the storage options
(:mod:`fanstore.storage.options`): keyword arguments of ``s3fs.S3FileSystem``, plus
FanStore's own ``retries`` (attempts after the first, default 5), ``timeout`` (connect and
read timeout in seconds, default 30; an upload may take that plus 1 s per MiB it sends)
and ``part_size_mb`` (multipart upload part size, default 16).

Every request is retried on transient errors (timeouts, refused connections, 5xx) with an
exponential backoff (0.5 s doubling, at most 10 s), each retry logged as a warning; then it
fails with one line naming the object. A missing bucket or refused credentials fail at once.
s3fs is imported on first use, so this module loads without it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from fanstore.errors import StorageError, UsageError
from fanstore.storage.location import Location, scheme_of

log = logging.getLogger(__name__)


#: Multipart upload part size (S3 wants at least 5 MiB for every part but the last).
PART_SIZE = 16 << 20
DEFAULT_RETRIES = 5
DEFAULT_TIMEOUT = 30.0


def _backoff(attempt: int) -> float:
    return min(10.0, 0.5 * 2 ** attempt)


def s3_filesystem_kwargs(options: dict[str, Any]) -> tuple[dict[str, Any], int, float]:
    """(kwargs for s3fs.S3FileSystem, retries, timeout) from the AWS environment and the
    storage options (which win)."""
    opts = dict(options)
    retries = opts.pop("retries", DEFAULT_RETRIES)
    timeout = opts.pop("timeout", DEFAULT_TIMEOUT)
    part_mb = opts.pop("part_size_mb", PART_SIZE >> 20)
    if not isinstance(part_mb, int) or isinstance(part_mb, bool) or not 5 <= part_mb <= 5120:
        raise UsageError("storage option 'part_size_mb' must be a whole number of MiB, 5-5120")
    opts["_part_size"] = part_mb << 20
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise UsageError("storage option 'retries' must be a whole number >= 0")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise UsageError("storage option 'timeout' must be a positive number of seconds")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in opts:
        opts["endpoint_url"] = endpoint
    client = dict(opts.pop("client_kwargs", None) or {})
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region and "region_name" not in client:
        client["region_name"] = region
    opts["client_kwargs"] = client
    config = dict(opts.pop("config_kwargs", None) or {})
    config.setdefault("connect_timeout", timeout)
    config.setdefault("read_timeout", timeout)
    # FanStore retries itself (and says so); botocore's own retries would hide the waits.
    config.setdefault("retries", {"total_max_attempts": 1})
    opts["config_kwargs"] = config
    opts["skip_instance_cache"] = True  # one client per process: forked workers make theirs
    return opts, retries, float(timeout)


class S3Location(Location):
    """An S3 prefix ``s3://bucket/prefix`` through s3fs (aiobotocore)."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        rest = url[len(scheme_of(url)) + 3:].strip("/")
        if not rest:
            raise UsageError(f"{url}: no bucket named")
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/")
        self.url = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.kwargs, self.retries, self.timeout = s3_filesystem_kwargs(options)
        self.part_size = self.kwargs.pop("_part_size")
        self._fs = None
        self._pid = 0

    @property
    def fs(self):
        if self._fs is None or self._pid != os.getpid():  # a forked worker makes its own
            import s3fs

            fs = s3fs.S3FileSystem(**self.kwargs)
            fs.retries = 1  # s3fs's own retry loop off: see _call
            self._fs, self._pid = fs, os.getpid()
        return self._fs

    @property
    def endpoint(self) -> str:
        return self.kwargs.get("endpoint_url") or "AWS S3"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix and name else (name or self.prefix)

    def with_prefix(self, prefix: str) -> S3Location:
        """Another location in the same bucket, sharing this one's client."""
        other = S3Location.__new__(S3Location)
        other.__dict__.update(self.__dict__)
        other.prefix = prefix.strip("/")
        other.url = f"s3://{self.bucket}" + (f"/{other.prefix}" if other.prefix else "")
        return other

    # -- the retry loop
    def _call(self, what: str, func: Callable[[], Any]) -> Any:
        attempt = 0
        while True:
            try:
                return func()
            except Exception as exc:  # noqa: BLE001 - sorted below
                fatal, reason = self._classify(exc)
                if fatal is not None:
                    raise fatal from None
                if attempt >= self.retries:
                    n = attempt + 1
                    raise StorageError(
                        f"{what}: {reason} (gave up after {n} attempt{'s' if n > 1 else ''}; "
                        f"endpoint {self.endpoint})") from None
                wait = _backoff(attempt)
                attempt += 1
                log.warning("%s: %s; retrying in %.1f s (retry %d of %d)", what, reason, wait,
                            attempt, self.retries)
                time.sleep(wait)

    def _classify(self, exc: BaseException) -> tuple[BaseException | None, str]:
        """(error to raise now, or None if worth retrying; a one-line reason)."""
        reason = " ".join(str(exc).split()) or type(exc).__name__
        name = type(exc).__name__
        if name == "FSTimeoutError":
            reason = "no answer in time (the endpoint stopped answering?)"
        if isinstance(exc, FileNotFoundError):
            if "bucket" in reason.lower():
                return StorageError(f"{self.url}: bucket {self.bucket!r} does not exist "
                                    f"(endpoint {self.endpoint})"), reason
            return exc, reason  # a missing object: the caller decides
        if isinstance(exc, PermissionError) or name in ("NoCredentialsError",
                                                       "PartialCredentialsError"):
            return StorageError(
                f"{self.url}: access denied by {self.endpoint} ({reason}); check the "
                "credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "--storage-options)"), reason
        if isinstance(exc, (UsageError, StorageError, KeyboardInterrupt)):
            return exc, reason
        if name in ("ParamValidationError", "InvalidBucketName", "ValueError", "TypeError"):
            return StorageError(f"{self.url}: {reason}"), reason
        if name == "NoSuchUpload":
            return StorageError(f"{self.url}: {reason}"), reason
        return None, f"{name}: {reason}" if name not in reason else reason

    # -- operations
    def check(self) -> None:
        try:
            self._call(f"checking bucket s3://{self.bucket}",
                       lambda: self.fs.call_s3("head_bucket", Bucket=self.bucket))
        except FileNotFoundError:
            raise StorageError(f"{self.url}: bucket {self.bucket!r} does not exist "
                               f"(endpoint {self.endpoint})") from None

    def read_bytes(self, name: str) -> bytes:
        path = f"{self.bucket}/{self.key(name)}"
        return self._call(f"reading {self.show(name)}", lambda: self.fs.cat_file(path))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        path = f"{self.bucket}/{self.key(name)}"
        data = self._call(f"reading {self.show(name)} bytes {start}-{end - 1}",
                          lambda: self.fs.cat_file(path, start=start, end=end))
        if len(data) != end - start:
            raise StorageError(f"{self.show(name)}: short read ({len(data)} of {end - start} "
                               f"bytes at {start}; the object changed?)")
        return data

    def size(self, name: str) -> int | None:
        try:
            head = self._call(f"looking up {self.show(name)}", lambda: self.fs.call_s3(
                "head_object", Bucket=self.bucket, Key=self.key(name)))
        except FileNotFoundError:
            return None
        return int(head["ContentLength"])

    def list(self) -> dict[str, tuple[int, int]]:
        """Objects under ``prefix/`` (keys ending in '/' - directory markers - left out)."""
        out: dict[str, tuple[int, int]] = {}
        base = self.prefix + "/" if self.prefix else ""
        token = None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": base}
            if token:
                kw["ContinuationToken"] = token
            page = self._call(f"listing {self.url}/",
                              lambda kw=kw: self.fs.call_s3("list_objects_v2", **kw))
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/"):
                    continue
                mtime = obj.get("LastModified")
                ns = int(mtime.timestamp() * 1e9) if mtime is not None else 0
                out[key[len(base):]] = (int(obj["Size"]), ns)
            if not page.get("IsTruncated"):
                return out
            token = page.get("NextContinuationToken")

    def list_prefixes(self, start: str) -> list[str]:
        """Top-level "directories" in this location's parent whose name begins with
        ``start`` (used to find temporary prefixes of interrupted packs)."""
        parent = self.prefix.rpartition("/")[0]
        base = parent + "/" if parent else ""
        found: list[str] = []
        token = None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": base + start, "Delimiter": "/"}
            if token:
                kw["ContinuationToken"] = token
            page = self._call(f"listing s3://{self.bucket}/{base}",
                              lambda kw=kw: self.fs.call_s3("list_objects_v2", **kw))
            found += [p["Prefix"].rstrip("/") for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                return found
            token = page.get("NextContinuationToken")

    def open_write(self, name: str) -> S3Writer:
        return S3Writer(self, name, self.part_size)

    def upload_timeout(self, nbytes: int) -> float:
        """Wall-clock limit of a request that sends ``nbytes``: botocore's read timeout
        never fires while a send is stuck (an endpoint that stopped reading), so uploads
        get ``timeout`` plus the time to send the body at 1 MiB/s."""
        return self.timeout + nbytes / (1 << 20)

    def remove(self, names: list[str]) -> None:
        keys = [self.key(n) for n in names]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            self._call(f"removing objects under {self.url}", lambda batch=batch: self.fs.call_s3(
                "delete_objects", Bucket=self.bucket, Delete=batch))

    def copy_from(self, src: S3Location, name: str, dst_name: str | None = None) -> None:
        """Server-side copy of ``src``/name to this location (no bytes through FanStore)."""
        a = f"{src.bucket}/{src.key(name)}"
        b = f"{self.bucket}/{self.key(dst_name or name)}"
        self._call(f"copying {src.show(name)} to {self.show(dst_name or name)}",
                   lambda: self.fs.copy(a, b))


class S3Writer:
    """Writes one object: a single PUT when small, else a multipart upload of PART_SIZE
    parts, each part retried on its own. The object exists only after ``close``."""

    def __init__(self, loc: S3Location, name: str, part_size: int = PART_SIZE) -> None:
        self.loc = loc
        self.name = name
        self.key = loc.key(name)
        self.part_size = part_size
        self._buf = bytearray()
        self._parts: list[dict[str, Any]] = []
        self._upload_id: str | None = None
        self.closed = False

    def write(self, data) -> int:
        self._buf += data
        while len(self._buf) >= self.part_size:
            self._upload(bytes(self._buf[:self.part_size]))
            del self._buf[:self.part_size]
        return len(data)

    def _upload(self, body: bytes) -> None:
        loc = self.loc
        what = f"writing {loc.show(self.name)}"
        if self._upload_id is None:
            res = loc._call(what, lambda: loc.fs.call_s3(
                "create_multipart_upload", Bucket=loc.bucket, Key=self.key))
            self._upload_id = res["UploadId"]
        number = len(self._parts) + 1
        res = loc._call(f"{what} (part {number})", lambda: loc.fs.call_s3(
            "upload_part", Bucket=loc.bucket, Key=self.key, UploadId=self._upload_id,
            PartNumber=number, Body=body, timeout=loc.upload_timeout(len(body))))
        self._parts.append({"PartNumber": number, "ETag": res["ETag"]})

    def close(self) -> None:
        if self.closed:
            return
        loc = self.loc
        what = f"writing {loc.show(self.name)}"
        if self._upload_id is None:
            body = bytes(self._buf)
            loc._call(what, lambda: loc.fs.call_s3("put_object", Bucket=loc.bucket,
                                                   Key=self.key, Body=body,
                                                   timeout=loc.upload_timeout(len(body))))
        else:
            if self._buf or not self._parts:
                self._upload(bytes(self._buf))
            loc._call(what, lambda: loc.fs.call_s3(
                "complete_multipart_upload", Bucket=loc.bucket, Key=self.key,
                UploadId=self._upload_id, MultipartUpload={"Parts": self._parts}))
        self._buf = bytearray()
        self.closed = True

    def abort(self) -> None:
        """Drop the upload: nothing appears (best effort: the endpoint may be gone)."""
        self.closed = True
        self._buf = bytearray()
        if self._upload_id is not None:
            loc = self.loc
            try:
                loc.fs.call_s3("abort_multipart_upload", Bucket=loc.bucket, Key=self.key,
                               UploadId=self._upload_id, timeout=loc.timeout)
            except Exception as exc:  # noqa: BLE001 - cleanup only
                log.debug("aborting the upload of %s: %s", loc.show(self.name), exc)

