"""Incomplete multipart uploads below a chain on S3 (spec §7.7): listing and aborting them.

A writer killed during a multipart upload (an anchor, a large batch) leaves the upload open.
Its parts are stored and billed, but they are no object: no reader sees them and garbage
collection, which lists objects, cannot find them. ``compact`` aborts them while it holds the
writer lock, when no other writer may be uploading.

obstore can neither list nor abort uploads, so this module uses botocore, which the ``s3``
extra installs, configured from the same environment variables as the store
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``) and the same ``storage_options`` keys. GCS and Azure
are not covered: on GCS configure the bucket's lifecycle rule (``AbortIncompleteMultipartUpload``
on S3 does the same); Azure discards uncommitted blocks after seven days on its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import UsageError

S3_SCHEMES = frozenset({"s3", "s3a"})


@dataclass(frozen=True)
class Upload:
    """One incomplete multipart upload."""

    key: str  # relative to the chain, e.g. "anchors/00000012-....safetensors"
    upload_id: str
    initiated: datetime | None


def supported(url: str) -> bool:
    """Whether uploads below ``url`` can be listed and aborted here (S3 URLs)."""
    return url.split("://", 1)[0].lower() in S3_SCHEMES


def _option(options: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        for key in (name, f"aws_{name}"):
            if options.get(key) is not None:
                return options[key]
    return None


def _client(bucket: str, storage_options: Mapping[str, Any] | None) -> Any:
    try:
        import botocore.config
        import botocore.session
    except ImportError:
        raise UsageError("aborting incomplete multipart uploads needs botocore: pip install 'ldformat[s3]'") from None
    options = {k.lower(): v for k, v in (storage_options or {}).items()}
    endpoint = (_option(options, "endpoint", "endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))
    region = (_option(options, "region", "default_region") or os.environ.get("AWS_REGION")
              or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    session = botocore.session.get_session()
    return session.create_client(
        "s3", region_name=region, endpoint_url=endpoint,
        aws_access_key_id=_option(options, "access_key_id"),
        aws_secret_access_key=_option(options, "secret_access_key"),
        aws_session_token=_option(options, "session_token", "token"),
        config=botocore.config.Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=10,
                                      read_timeout=30),
    )


def _bucket_prefix(url: str) -> tuple[str, str]:
    rest = url.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def list_uploads(url: str, storage_options: Mapping[str, Any] | None = None) -> list[Upload]:
    """The incomplete multipart uploads below the chain at ``url`` (an ``s3://`` URL).

    Raises:
        UsageError: not an S3 URL, or botocore is missing.
        OSError: the request failed (names the URL).
    """
    if not supported(url):
        raise UsageError(f"{url}: listing multipart uploads is supported on s3:// only")
    bucket, prefix = _bucket_prefix(url)
    client = _client(bucket, storage_options)
    out: list[Upload] = []
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
            for u in page.get("Uploads", []):
                out.append(Upload(key=u["Key"][len(prefix):], upload_id=u["UploadId"], initiated=u.get("Initiated")))
    except Exception as e:  # botocore's ClientError, EndpointConnectionError, ...
        raise OSError(f"{url}: listing incomplete multipart uploads failed: {e}") from None
    return out


def abort_uploads(url: str, uploads: list[Upload], storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Abort ``uploads`` below the chain at ``url``; returns the keys aborted (an upload that
    is already gone counts: someone completed or aborted it meanwhile)."""
    bucket, prefix = _bucket_prefix(url)
    client = _client(bucket, storage_options)
    done = []
    for u in uploads:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=prefix + u.key, UploadId=u.upload_id)
        except Exception as e:
            code = getattr(e, "response", {}).get("Error", {}).get("Code")
            if code != "NoSuchUpload":
                raise OSError(f"{url}/{u.key}: aborting the incomplete multipart upload {u.upload_id} failed: "
                              f"{e}") from None
        done.append(u.key)
    return done
