"""Before anything runs: can the storage be reached, with these credentials, in this bucket?

Each problem becomes one ConfigError line (exit 2). Nothing is written while checking.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from orchestrator.errors import ConfigError, one_line
from orchestrator.storage.location import StorageSpec, refused_credentials

UNREACHABLE = ("curlCode: 7", "curlCode: 28", "Couldn't connect", "Connection refused",
                "Timeout was reached", "Could not resolve", "curlCode: 6")


def check_storage(spec: StorageSpec) -> bool:
    """Raise ConfigError if the storage cannot be used; return True if a bucket must be made."""
    if not spec.is_s3:
        spec.filesystem()  # unknown schemes fail here
        return False
    fs, _ = spec.filesystem(connect_timeout=3.0, request_timeout=10.0,
                            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    where = spec.endpoint or "AWS S3"
    try:
        info = fs.get_file_info(spec.bucket)
    except OSError as exc:
        text = spec.credentials.scrub(str(exc)) if spec.credentials else str(exc)
        if any(marker in text for marker in UNREACHABLE):
            raise ConfigError(f"storage.endpoint={spec.endpoint!r}: nothing answers at {where}") from None
        if refused_credentials(text):
            if spec.credentials is None and not chain_sources():
                raise ConfigError(
                    f"storage: {where} refuses the request: this machine has no AWS "
                    "credentials (no AWS_ACCESS_KEY_ID, no profile file, no web identity "
                    "token, no instance role answered); a job started by `ray job submit` has "
                    "the cluster's environment, not your shell's: give the nodes a profile "
                    "(~/.aws/credentials) or a role") from None
            source = ("from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" if spec.credentials
                      else "the AWS credential chain found (profile, its files, web identity)")
            raise ConfigError(
                f"storage: {where} refuses the credentials {source} (wrong key or secret, "
                f"expired, or no access to bucket {spec.bucket!r})") from None
        raise ConfigError(f"storage.uri={spec.uri!r}: {one_line(text)[:200]}") from None
    if info.type == pafs.FileType.NotFound:
        if not spec.create_bucket:
            raise ConfigError(
                f"storage.uri={spec.uri!r}: bucket {spec.bucket!r} does not exist at {where} "
                "(create it, or allow storage.create_bucket=true)")
        return True
    return False


def chain_sources() -> list[str]:
    """The places the AWS credential chain would find credentials on this machine (by name,
    never their values); an instance role is not asked for here."""
    home = os.path.expanduser("~")
    places = {
        "AWS_ACCESS_KEY_ID": bool(os.environ.get("AWS_ACCESS_KEY_ID")),
        "AWS_PROFILE": bool(os.environ.get("AWS_PROFILE")),
        "AWS_WEB_IDENTITY_TOKEN_FILE": bool(os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE")),
        "AWS_CONTAINER_CREDENTIALS": any(os.environ.get(f"AWS_CONTAINER_CREDENTIALS_{k}_URI")
                                         for k in ("RELATIVE", "FULL")),
        "credentials file": os.path.isfile(os.environ.get(
            "AWS_SHARED_CREDENTIALS_FILE", os.path.join(home, ".aws", "credentials"))),
        "config file": os.path.isfile(os.environ.get(
            "AWS_CONFIG_FILE", os.path.join(home, ".aws", "config"))),
    }
    return [name for name, found in places.items() if found]


def create_bucket(spec: StorageSpec) -> None:
    fs, _ = spec.filesystem()
    fs.create_dir(spec.bucket)
