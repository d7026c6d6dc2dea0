"""Storage locations as plain ``str`` URIs, resolved to a pyarrow filesystem and a path.

A bare path is a local directory (made absolute, since Ray workers run elsewhere);
``s3://bucket/prefix`` goes through pyarrow's S3 filesystem, with credentials taken from the
environment only; any other scheme pyarrow understands (``file://``, ``gs://``...) works too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow.fs as pafs

from orchestrator.errors import ConfigError


@dataclass(frozen=True)
class StorageSpec:
    """What a worker needs to reach the storage; never holds credentials."""

    uri: str
    endpoint: str | None = None
    region: str = "us-east-1"

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        return open_uri(self.uri, endpoint=self.endpoint, region=self.region)

    def child(self, *parts: str) -> StorageSpec:
        return StorageSpec(join(self.uri, *parts), self.endpoint, self.region)


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def absolute(uri: str) -> str:
    """Local paths become absolute (workers do not share the driver's working directory)."""
    if "://" in uri:
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def open_uri(uri: str, endpoint: str | None = None, region: str = "us-east-1"):
    """Return (filesystem, path inside it) for a URI."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), absolute(uri)
    scheme, rest = uri.split("://", 1)
    if scheme == "s3":
        if not rest or rest.startswith("/"):
            raise ConfigError(f"storage.uri={uri!r} is not allowed: s3://bucket/prefix")
        kwargs = {"region": region}
        if endpoint:
            endpoint_scheme = endpoint.split("://", 1)[0] if "://" in endpoint else "https"
            kwargs.update(endpoint_override=endpoint, scheme=endpoint_scheme)
        return pafs.S3FileSystem(**kwargs), rest.rstrip("/")
    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for unknown schemes
        raise ConfigError(
            f"storage.uri={uri!r} is not allowed: a directory, s3://bucket/prefix or another "
            f"URI pyarrow understands ({str(exc).splitlines()[0]})"
        ) from exc
