"""Storage locations as plain ``str`` URIs, resolved to a pyarrow filesystem and a path.

A bare path is a local directory (made absolute, since Ray workers run elsewhere);
``s3://bucket/prefix`` goes through pyarrow's S3 filesystem with credentials from the
environment only; any other scheme pyarrow understands (``file://``, ``gs://``...) works too.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from orchestrator.errors import ConfigError, one_line

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class Credentials:
    """S3 keys read from the environment. Never printed: repr and str hide them, because
    Ray Train stringifies the train loop config into the run state the dashboard shows."""

    __slots__ = ("access_key", "secret_key", "session_token")

    def __init__(self, access_key: str, secret_key: str, session_token: str | None = None):
        self.access_key, self.secret_key, self.session_token = access_key, secret_key, session_token

    @classmethod
    def from_env(cls) -> Credentials | None:
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        return cls(key, secret, os.environ.get("AWS_SESSION_TOKEN")) if key and secret else None

    def scrub(self, text: str) -> str:
        for value in (self.secret_key, self.session_token, self.access_key):
            if value:
                text = text.replace(value, "***")
        return text

    def __getstate__(self):
        return (self.access_key, self.secret_key, self.session_token)

    def __setstate__(self, state):
        self.access_key, self.secret_key, self.session_token = state

    def __repr__(self) -> str:
        return "Credentials(***)"

    __str__ = __repr__


# Where the AWS SDK's credential chain looks (a profile, its files, a web identity), as the
# driver's environment names it: every worker is given these and reads the credentials on its
# own node through the same chain, which refreshes them (SSO, an assumed role, a web identity
# token, an instance profile). Pointers, not secrets: keys themselves are only ever handed over
# when the environment holds them (Credentials.from_env), fixed values by their nature.
CHAIN_ENV = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
             "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME",
             "AWS_EC2_METADATA_DISABLED")
# What an S3 server answers to credentials it does not take (wrong, revoked or expired).
REFUSED = ("ACCESS_DENIED", "InvalidAccessKeyId", "SignatureDoesNotMatch", "HTTP status 403",
           "AccessDenied", "Forbidden", "ExpiredToken", "InvalidToken", "TokenRefreshRequired")


def refused_credentials(exc: BaseException) -> bool:
    return any(marker in str(exc) for marker in REFUSED)


def credential_chain_env() -> dict[str, str]:
    """The chain's pointers to hand to the workers (none when the keys are in the environment:
    the chain would take those first, and they are handed over as Credentials)."""
    if Credentials.from_env() is not None:
        return {}
    return {name: os.environ[name] for name in CHAIN_ENV if os.environ.get(name)}


@dataclass(frozen=True)
class StorageSpec:
    """What a worker needs to reach the storage."""

    uri: str
    endpoint: str | None = None
    region: str = "us-east-1"
    credentials: Credentials | None = field(default=None, compare=False)
    create_bucket: bool = False
    key: str = field(default="storage.uri", compare=False)  # the config key its errors name

    def filesystem(self, **s3_options) -> tuple[pafs.FileSystem, str]:
        return open_uri(self, **s3_options)

    def child(self, *parts: str) -> StorageSpec:
        return StorageSpec(join(self.uri, *parts), self.endpoint, self.region, self.credentials,
                           self.create_bucket, self.key)

    def sibling(self, uri: str, key: str = "storage.uri") -> StorageSpec:
        """Another URI reached the same way (same endpoint and credentials), given as ``key``."""
        return StorageSpec(absolute(uri), self.endpoint, self.region, self.credentials, key=key)

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    @property
    def bucket(self) -> str:
        return self.uri[len("s3://"):].split("/", 1)[0]


def absolute(uri: str) -> str:
    """Local paths become absolute (workers do not share the driver's working directory)."""
    if "://" in uri:
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def check_s3_uri(uri: str, key: str = "storage.uri") -> None:
    rest = uri[len("s3://"):]
    bucket = rest.split("/", 1)[0]
    if not bucket or not _BUCKET.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"{key}={uri!r} is not allowed: s3://bucket/prefix with a bucket name of 3-63 "
            "lowercase letters, digits, dots or hyphens"
        )


def open_uri(spec: StorageSpec, **s3_options) -> tuple[pafs.FileSystem, str]:
    """Return (filesystem, path inside it) for a storage spec."""
    uri = spec.uri
    if "://" not in uri:
        return pafs.LocalFileSystem(), absolute(uri)
    scheme, rest = uri.split("://", 1)
    if scheme == "s3":
        check_s3_uri(uri, spec.key)
        kwargs = {"region": spec.region, "connect_timeout": 5.0, "request_timeout": 60.0,
                  "allow_bucket_creation": spec.create_bucket}
        if spec.endpoint:
            endpoint_scheme = spec.endpoint.split("://", 1)[0] if "://" in spec.endpoint else "https"
            kwargs.update(endpoint_override=spec.endpoint, scheme=endpoint_scheme)
        if spec.credentials:
            c = spec.credentials
            kwargs.update(access_key=c.access_key, secret_key=c.secret_key)
            if c.session_token:
                kwargs["session_token"] = c.session_token
        kwargs.update(s3_options)
        return pafs.S3FileSystem(**kwargs), rest.rstrip("/")
    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for unknown schemes
        raise ConfigError(
            f"{spec.key}={uri!r} is not allowed: a directory, s3://bucket/prefix or another "
            f"URI pyarrow understands ({one_line(exc)})"
        ) from exc
