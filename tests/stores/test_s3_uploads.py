"""``compact`` aborts the incomplete multipart uploads a killed writer leaves below an S3
chain (spec §7.7), and only those: uploads below other prefixes stay."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from models import TinyNet, train_step
from s3server import BUCKET, MotoServer

import ldformat
from ldformat import ChainWriter
from ldformat.stores import uploads
from ldtools.cli import cli

pytest_plugins = ["s3server"]


def _client(server: MotoServer) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def _start_upload(client: Any, key: str) -> str:
    """A multipart upload with one part, never completed: what a writer killed mid-upload leaves."""
    upload_id: str = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * (5 << 20))
    return upload_id


def _open_uploads(client: Any, prefix: str) -> set[str]:
    return {u["Key"] for u in client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])}


@pytest.mark.server
def test_compact_aborts_the_uploads_a_killed_writer_left(s3_env: MotoServer) -> None:
    name = f"uploads-{secrets.token_hex(4)}"
    url = f"s3://{BUCKET}/{name}"
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ChainWriter.create(url, model, optimizer, kind="state.xor", batch_steps=1, anchor_every=3) as writer:
        for step in range(1, 5):
            train_step(model, optimizer, step)
            writer.record_step(step)
    client = _client(s3_env)
    mine = {f"{name}/anchors/00000005-stale.safetensors", f"{name}/deltas/00000006-stale/values/c/0"}
    for key in mine:
        _start_upload(client, key)
    other = f"{name}-other/anchors/00000001.safetensors"  # another chain whose prefix starts alike
    _start_upload(client, other)
    assert _open_uploads(client, f"{name}/") == mine

    listed = {u.key for u in uploads.list_uploads(url)}
    assert listed == {k.removeprefix(f"{name}/") for k in mine}

    runner = CliRunner()
    dry = runner.invoke(cli, ["compact", url, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert set(json.loads(dry.output)["aborted_uploads"]) == listed
    assert _open_uploads(client, f"{name}/") == mine  # a dry run aborts nothing

    result = runner.invoke(cli, ["compact", url])
    assert result.exit_code == 0, result.output
    assert "abort 2 incomplete multipart uploads" in result.output
    assert _open_uploads(client, f"{name}/") == set()
    assert _open_uploads(client, f"{name}-other/") == {other}, "an upload of another chain was aborted"
    assert ldformat.validate(url).ok
    assert ldformat.ChainReader(url).materialize()["step"] == 4

    again = ldformat.compact(url)
    assert again.aborted_uploads == [] and again.uploads_problem is None
    client.abort_multipart_upload(Bucket=BUCKET, Key=other,
                                  UploadId=client.list_multipart_uploads(Bucket=BUCKET, Prefix=other)["Uploads"][0][
                                      "UploadId"])


@pytest.mark.server
def test_an_unlistable_bucket_is_a_warning_not_a_failed_compaction(s3_env: MotoServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{BUCKET}/uploads-{secrets.token_hex(4)}"
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ChainWriter.create(url, model, optimizer, kind="state.xor") as writer:
        train_step(model, optimizer, 1)
        writer.record_step(1)

    def denied(url: str, storage_options: Any = None) -> list[uploads.Upload]:
        raise OSError(f"{url}: listing incomplete multipart uploads failed: AccessDenied")

    monkeypatch.setattr(uploads, "list_uploads", denied)
    result = CliRunner().invoke(cli, ["compact", url])
    assert result.exit_code == 0, result.output
    assert "were not cleaned up" in result.output and "AccessDenied" in result.output
    assert ldformat.validate(url).ok


def test_uploads_are_listed_on_s3_urls_only() -> None:
    assert uploads.supported("s3://b/p") and uploads.supported("S3A://b/p")
    assert not uploads.supported("gs://b/p") and not uploads.supported("memory://x")
    with pytest.raises(ldformat.UsageError, match="s3:// only"):
        uploads.list_uploads("gs://b/p")
