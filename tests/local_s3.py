"""A local S3 server (moto) on a free 127.0.0.1 port for the tests of run directories on a bucket, and what they
read from it straight (boto3, not the code under test)."""

import contextlib
import socket

COMMIT_FILE = "commit_success.txt"  # Orbax's marker of a committed step on a bucket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forget_clients() -> None:
    """Drops the s3fs filesystems made so far (etils.epath's and fsspec's caches of them): each holds the endpoint
    of its time, and a test module's server is not the previous module's."""
    import s3fs
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def moto_server():
    """Yields the server's URL while it runs; the s3fs filesystems of an earlier server are forgotten."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    forget_clients()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        forget_clients()


def aws_env(endpoint: str) -> dict[str, str]:
    """The AWS_* variables of a client of `endpoint` with the server's test credentials, no other AWS set-up."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret",
            "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}


@contextlib.contextmanager
def bucket_on(endpoint: str, bucket: str, *, clients_via: str | None = None):
    """Creates `bucket` on the server at `endpoint` and yields a boto3 client straight to that server, while the
    AWS_* variables send the code under test to `clients_via` (a proxy in front of it; default: the server)."""
    import boto3
    import pytest

    with pytest.MonkeyPatch.context() as env:
        for key, value in aws_env(clients_via or endpoint).items():
            env.setenv(key, value)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        yield client


def keys(client, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", ()))


def committed_steps(client, bucket: str, run: str) -> list[int]:
    """Step folders under RUN/checkpoints/ that hold their commit marker."""
    prefix = f"{run}/checkpoints/"
    found = [key[len(prefix):] for key in keys(client, bucket, prefix)]
    return sorted({int(key.split("/")[0]) for key in found if key.count("/") == 1
                   and key.endswith("/" + COMMIT_FILE)})
