"""Where a store or a source lives: a local directory or an object-store prefix (``s3://``).

``open_location(url)`` gives a :class:`Location` with the few operations FanStore needs:
read an object whole or a byte range of it, its size, list what lies under the location,
write an object (S3: multipart upload), copy and remove objects. Local paths and S3 prefixes
behave the same; FanStore code outside this package never imports s3fs or botocore.

This package's public face; each job lives in a module of its own:

- :mod:`fanstore.storage.location`: the :class:`Location` interface, the local backend and
  the scheme registry held as data (:data:`KNOWN_SCHEMES`: the class to use, the modules it
  needs and an install hint, imported on first use).
- :mod:`fanstore.storage.options`: the storage options (``--storage-options JSON``,
  ``$FANSTORE_STORAGE_OPTIONS``, ``@FILE``) and the warnings when they expose credentials.
- :mod:`fanstore.storage.s3`: the S3 backend (s3fs, the optional extra ``fanstore[s3]``):
  the AWS environment, retries with backoff, multipart writes.
"""

from __future__ import annotations

from fanstore.storage.location import (
    KNOWN_SCHEMES,
    LocalLocation,
    Location,
    is_url,
    open_location,
    scheme_of,
    split_parent,
)
from fanstore.storage.options import (
    default_options,
    explicit_options,
    exposure_warnings,
    parse_storage_options,
    secret_names,
    set_default_options,
)

__all__ = [
    "KNOWN_SCHEMES",
    "LocalLocation",
    "Location",
    "default_options",
    "explicit_options",
    "exposure_warnings",
    "is_url",
    "open_location",
    "parse_storage_options",
    "scheme_of",
    "secret_names",
    "set_default_options",
    "split_parent",
]
