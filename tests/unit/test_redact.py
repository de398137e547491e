"""Credentials in URIs are redacted in text, in nested config data and in everything printed."""

from __future__ import annotations

import io

import pytest

from shardwise.common.redact import RedactingStream, redact, redacted


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://user:pass@mlflow:5000", "http://***@mlflow:5000"),
        ("s3://AKIAXYZ:wJalr/x+y@bucket/runs", "s3://***@bucket/runs"),
        ("https://ghp_token123@github.com/org/repo", "https://***@github.com/org/repo"),
        ("tracking.uri = 'http://a:b@h/x'", "tracking.uri = 'http://***@h/x'"),
        ("https://h/x?token=abc&page=2", "https://h/x?token=***&page=2"),
        ("https://b.s3/k?X-Amz-Signature=f00&X-Amz-Credential=AK%2F1", "https://b.s3/k"
         "?X-Amz-Signature=***&X-Amz-Credential=***"),
        ("postgresql://u:p@db/mlflow and ray://r:s@head:10001", "postgresql://***@db/mlflow and "
         "ray://***@head:10001"),
    ],
)  # fmt: skip
def test_credentials_in_uris_are_hidden(text, shown):
    assert redact(text) == shown


@pytest.mark.parametrize(
    "text",
    [
        "runs/digits/checkpoints/step_00000005",
        "s3://bucket/runs/a@b",  # an @ in the path, not user info
        "http://mlflow:5000/#/experiments/1",
        "file:///data/img@2x.png",
        "lr=0.001 steps=20 keep_last=2",
        "user@example.com wrote ?page=2",
    ],
)
def test_text_without_credentials_is_unchanged(text):
    assert redact(text) == text


def test_nested_config_data_is_redacted_and_the_original_kept():
    data = {"tracking": {"uri": "http://u:p@h"}, "list": ["s3://k:s@b", 3], "n": 1.5}
    assert redacted(data) == {
        "tracking": {"uri": "http://***@h"},
        "list": ["s3://***@b", 3],
        "n": 1.5,
    }
    assert data["tracking"]["uri"] == "http://u:p@h"


def test_a_stream_redacts_a_uri_split_across_writes():
    inner = io.StringIO()
    stream = RedactingStream(inner)
    for part in ("uri: http://al", "ice:s3cr3t@h", "ost/x\nnext ", "line"):
        stream.write(part)
    stream.flush()
    assert inner.getvalue() == "uri: http://***@host/x\nnext line"
