"""Where a store or a source lives: a local directory or an object-store prefix (``s3://``).

``open_location(url)`` gives a :class:`Location` with the few operations FanStore needs:
read an object whole or a byte range of it, its size, list what lies under the location,
write an object (S3: multipart upload), copy and remove objects. Local paths and S3 prefixes
behave the same; FanStore code above this module never imports s3fs or botocore.

Schemes are a registry held as data (:data:`KNOWN_SCHEMES`): the class to use, the modules
it needs and an install hint, imported on first use (s3fs is the optional extra
``fanstore[s3]``).

S3 configuration follows the standard AWS environment (``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``,
``AWS_SHARED_CREDENTIALS_FILE``), then the storage options (``--storage-options JSON``, or
``$FANSTORE_STORAGE_OPTIONS``; either may be ``@FILE``, a file holding the JSON): keyword
arguments of ``s3fs.S3FileSystem``, plus FanStore's own ``retries`` (attempts after the
first, default 5), ``timeout`` (connect and read timeout in seconds, default 30; an upload
may take that plus 1 s per MiB it sends) and ``part_size_mb`` (multipart upload part size,
default 16).

Credentials never need the command line, where every user of the node can read them
(``ps``, ``/proc/PID/cmdline``): the environment and files are private to their owner.
:func:`exposure_warnings` gives the lines the CLI shows when a secret (``key``,
``secret``, ``token``, a password...) is given in argv anyway, or sits in a file others may
read.

Every request is retried on transient errors (timeouts, refused connections, 5xx) with an
exponential backoff (0.5 s doubling, at most 10 s), each retry logged as a warning; then it
fails with one line naming the object. A missing bucket or refused credentials fail at once.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from types import MappingProxyType
from typing import Any, Callable

from fanstore.errors import StorageError, UsageError

log = logging.getLogger(__name__)

#: scheme -> how to open it. "modules" are imported before the class; "err" is the hint.
_KNOWN_SCHEMES: dict[str, dict[str, Any]] = {
    "s3": {
        "class": "fanstore.storage.S3Location",
        "modules": ("s3fs",),
        "err": "S3 support needs s3fs: pip install 'fanstore[s3]' (or pip install s3fs)",
    },
}
KNOWN_SCHEMES = MappingProxyType(_KNOWN_SCHEMES)

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

#: Storage options set by the command line (``--storage-options``); see default_options().
_default_options: dict[str, Any] | None = None


def is_url(text: str | bytes | os.PathLike) -> bool:
    """True for ``scheme://...`` (an object-store location), False for a local path."""
    if isinstance(text, os.PathLike):
        return False
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    return bool(_URL.match(text))


def scheme_of(url: str) -> str:
    m = _URL.match(url)
    return m.group(1).lower() if m else ""


#: Largest options file read (the JSON of a few keyword arguments).
_MAX_OPTIONS_FILE = 1 << 20


def _read_options_file(path: str, where: str) -> str:
    if not path:
        raise UsageError(f"{where}: '@' must be followed by the name of a file holding the "
                         "JSON")
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(_MAX_OPTIONS_FILE + 1)
    except OSError as exc:
        raise UsageError(f"{where}: cannot read {path}: {exc.strerror}") from None
    if len(data) > _MAX_OPTIONS_FILE:
        raise UsageError(f"{where}: {path} is larger than {_MAX_OPTIONS_FILE >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{where}: {path} is not UTF-8 text") from None


def parse_storage_options(text: str | None, where: str = "--storage-options") -> dict[str, Any]:
    """Storage options as a dict: ``text`` is a JSON object, or ``@FILE`` naming a file
    that holds one (credentials stay out of the command line); a clear UsageError
    otherwise. ``where`` names the setting in messages."""
    if not text:
        return {}
    if text.startswith("@"):
        where = f"{where} {text}"
        text = _read_options_file(text[1:], where)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected a JSON object, e.g. "
                         '\'{"timeout": 10, "retries": 3}\'')
    return value


#: Option names (any level, any case) that hold credentials: s3fs's ``key``/``secret``/
#: ``token``, botocore's ``aws_secret_access_key``/``aws_session_token``, passwords...
_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "access_key",
                 "api_key", "apikey", "private_key")
_SECRET_NAMES = frozenset({"key", "pass", "authorization"})


def secret_names(options: Any) -> list[str]:
    """The names of options (nested ones as ``outer.inner``) that look like credentials."""
    found: list[str] = []

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                name = str(k)
                low = name.lower()
                if low in _SECRET_NAMES or any(w in low for w in _SECRET_WORDS):
                    if v not in (None, "", {}, []):
                        found.append(prefix + name)
                else:
                    walk(v, f"{prefix}{name}.")
        elif isinstance(value, list):
            for v in value:
                walk(v, prefix)

    walk(options, "")
    return found


def exposure_warnings(text: str | None, options: dict[str, Any],
                      on_command_line: bool = True) -> list[str]:
    """Lines for the user when the storage options given as ``text`` expose a secret:
    inline on the command line (readable by every user of the node), or in an ``@FILE``
    that other users may read. ``on_command_line``: False for the environment (private
    to its owner; only an ``@FILE`` there is checked)."""
    names = secret_names(options)
    if not text or not names:
        return []
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if not text.startswith("@"):
        if not on_command_line:
            return []
        return [f"--storage-options on the command line holds credentials ({shown}), which "
                "every user of this node can read (ps, /proc/PID/cmdline) while FanStore "
                "runs; put them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                "AWS_SESSION_TOKEN), a credentials file (AWS_SHARED_CREDENTIALS_FILE) or a "
                "file of your own (--storage-options @FILE, mode 0600)"]
    path = os.path.expanduser(text[1:])
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return []
    if mode & 0o077:
        return [f"{text[1:]} holds credentials ({shown}) but other users may read it (mode "
                f"{mode & 0o7777:04o}); chmod 600 {text[1:]}"]
    return []


def set_default_options(options: dict[str, Any] | None) -> None:
    """Storage options for every location opened without explicit ones (the CLI sets them
    once; forked workers and daemons inherit them)."""
    global _default_options
    _default_options = dict(options) if options else None


def default_options() -> dict[str, Any]:
    if _default_options is not None:
        return dict(_default_options)
    return parse_storage_options(os.environ.get("FANSTORE_STORAGE_OPTIONS"),
                                 where="$FANSTORE_STORAGE_OPTIONS")


def open_location(url: str, options: dict[str, Any] | None = None) -> "Location":
    """A :class:`Location` for a local directory path or a ``scheme://`` URL."""
    url = os.fspath(url)
    if not is_url(url):
        return LocalLocation(url)
    scheme = scheme_of(url)
    if scheme == "file":
        return LocalLocation(url[len("file://"):])
    spec = _KNOWN_SCHEMES.get(scheme)
    if spec is None:
        known = ", ".join(f"{s}://" for s in sorted(_KNOWN_SCHEMES))
        raise UsageError(f"{url}: unknown storage scheme {scheme}:// (known: {known} and "
                         "local paths)")
    for mod in spec["modules"]:
        try:
            importlib.import_module(mod)
        except ImportError:
            raise StorageError(f"{url}: {spec['err']}") from None
    module, _, name = spec["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls(url, default_options() if options is None else options)


def split_parent(url: str) -> tuple[str, str]:
    """(parent location, last name) of a path or URL: ``s3://b/x/y`` -> (``s3://b/x``, ``y``)."""
    url = url.rstrip("/")
    parent, _, name = url.rpartition("/")
    return parent, name


class Location:
    """A directory-like place holding named objects (a local directory or an S3 prefix)."""

    url: str
    #: True when objects can be written in place and renamed (a local file system).
    local = False

    def show(self, name: str = "") -> str:
        """How users see ``name`` inside this location (a path or URL)."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def read_bytes(self, name: str) -> bytes:
        raise NotImplementedError

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``name``."""
        raise NotImplementedError

    def size(self, name: str) -> int | None:
        """Size of object ``name``, None if it does not exist."""
        raise NotImplementedError

    def list(self) -> dict[str, tuple[int, int]]:
        """Every object under this location: relative name -> (size, mtime in ns)."""
        raise NotImplementedError

    def open_write(self, name: str):
        """A writable binary file for ``name``: ``write``, ``close`` (the object appears
        only then) and ``abort`` (nothing appears)."""
        raise NotImplementedError

    def write_bytes(self, name: str, data: bytes) -> None:
        f = self.open_write(name)
        try:
            f.write(data)
        except BaseException:
            f.abort()
            raise
        f.close()

    def remove(self, names: list[str]) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Fail with one clear line if the location cannot be used at all (no bucket, ...)."""


# --------------------------------------------------------------------------- local


class LocalLocation(Location):
    local = True

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        self.url = self.path

    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_bytes(self, name: str) -> bytes:
        with open(self._p(name), "rb") as f:
            return f.read()

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with open(self._p(name), "rb", buffering=0) as f:
            return os.pread(f.fileno(), end - start, start)

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self._p(name)).st_size
        except FileNotFoundError:
            return None

    def list(self) -> dict[str, tuple[int, int]]:
        out = {}
        for top, _dirs, files in os.walk(self.path):
            for fn in files:
                p = os.path.join(top, fn)
                st = os.stat(p)
                out[os.path.relpath(p, self.path)] = (st.st_size, st.st_mtime_ns)
        return out

    def open_write(self, name: str):
        return _LocalWriter(self._p(name))

    def remove(self, names: list[str]) -> None:
        for n in names:
            try:
                os.unlink(self._p(n))
            except FileNotFoundError:
                pass


class _LocalWriter:
    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "wb", buffering=4 << 20)

    def write(self, data) -> int:
        return self._f.write(data)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- S3

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

    def with_prefix(self, prefix: str) -> "S3Location":
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
                              lambda: self.fs.call_s3("list_objects_v2", **kw))
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
                              lambda: self.fs.call_s3("list_objects_v2", **kw))
            found += [p["Prefix"].rstrip("/") for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                return found
            token = page.get("NextContinuationToken")

    def open_write(self, name: str) -> "S3Writer":
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
            self._call(f"removing objects under {self.url}", lambda: self.fs.call_s3(
                "delete_objects", Bucket=self.bucket, Delete=batch))

    def copy_from(self, src: "S3Location", name: str, dst_name: str | None = None) -> None:
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

