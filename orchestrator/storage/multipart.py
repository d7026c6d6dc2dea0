"""Multipart uploads a killed writer left unfinished under a run's prefix. An object store
keeps (and bills) their parts until they are aborted, and pyarrow can neither list nor abort
them: boto3 does, reaching the store as pyarrow does (the same endpoint and region, the keys
the run was given, else the same AWS credential chain)."""

from __future__ import annotations

import logging

from orchestrator.storage.location import StorageSpec

log = logging.getLogger(__name__)


def abort_unfinished_uploads(spec: StorageSpec) -> list[str]:
    """Abort every multipart upload under ``spec``'s prefix; return their keys. Call it only
    when nothing of the run writes (a worker group's start, the run's end). Errors are
    warnings: cleaning never stops a run."""
    if not spec.is_s3:
        return []
    from botocore.exceptions import BotoCoreError, ClientError

    aborted: list[str] = []
    try:
        client = s3_client(spec)
        for page in client.get_paginator("list_multipart_uploads").paginate(
                Bucket=spec.bucket, Prefix=key_prefix(spec)):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=spec.bucket, Key=upload["Key"],
                                              UploadId=upload["UploadId"])
                aborted.append(upload["Key"])
    except (BotoCoreError, ClientError) as exc:
        log.warning("aborting unfinished uploads under %s: %s", spec.uri, exc)
    if aborted:
        log.info("aborted %d unfinished uploads: %s", len(aborted), ", ".join(aborted))
    return aborted


def key_prefix(spec: StorageSpec) -> str:
    """The keys under the URI's folder: ``run/`` never matches a sibling ``run2/``."""
    rest = spec.uri[len("s3://"):].split("/", 1)
    folder = rest[1].strip("/") if len(rest) > 1 else ""
    return f"{folder}/" if folder else ""


def s3_client(spec: StorageSpec):
    import boto3
    from botocore.config import Config

    # An endpoint of its own (MinIO, SeaweedFS...) is addressed by path, as pyarrow does: a
    # bucket's name in the host needs a DNS name per bucket that such servers rarely have.
    addressing = {"addressing_style": "path"} if spec.endpoint else {}
    kwargs = {"region_name": spec.region,
              "config": Config(connect_timeout=5, read_timeout=60, s3=addressing,
                               retries={"max_attempts": 3, "mode": "standard"})}
    if spec.endpoint:
        kwargs["endpoint_url"] = spec.endpoint if "://" in spec.endpoint else f"https://{spec.endpoint}"
    if spec.credentials:
        c = spec.credentials
        kwargs.update(aws_access_key_id=c.access_key, aws_secret_access_key=c.secret_key,
                      aws_session_token=c.session_token)
    return boto3.client("s3", **kwargs)
