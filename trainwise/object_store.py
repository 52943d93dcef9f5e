"""Where checkpoints go: a local folder by default, S3 when a bucket is set.

The S3 client is handed in (built by `dagster_aws.s3.S3Resource` in `assets/resources.py`), so this
module needs neither Dagster nor credentials: boto3 finds those in its own environment chain.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol


class ObjectStore(Protocol):
    def put_file(self, local_path: Path, key: str) -> str: ...
    def get_file(self, key: str, local_path: Path) -> Path: ...
    def exists(self, key: str) -> bool: ...


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in Path(key).parts:
        raise ValueError(f"object key {key!r} must be a relative path without '..'")
    return key


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class LocalObjectStore:
    """Objects as files under one root folder; puts are atomic (copy to a temp file, rename)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def uri(self, key: str) -> str:
        return (self.root / _check_key(key)).as_uri()

    def put_file(self, local_path: Path, key: str) -> str:
        target = self.root / _check_key(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".put-")
        os.close(fd)
        try:
            shutil.copyfile(local_path, tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target.as_uri()

    def get_file(self, key: str, local_path: Path) -> Path:
        source = self.root / _check_key(key)
        if not source.exists():
            raise FileNotFoundError(f"object {key!r} not found under {self.root}")
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, local_path)
        return Path(local_path)

    def exists(self, key: str) -> bool:
        return (self.root / _check_key(key)).exists()


class S3ObjectStore:
    """Objects in an S3 bucket under a prefix, through a boto3 client (S3 puts are atomic)."""

    def __init__(self, client: Any, bucket: str, prefix: str = "trainwise") -> None:
        if len(bucket) < 3:
            raise ValueError(
                f"S3 bucket name {bucket!r} is too short: S3 needs 3-63 characters "
                "(set TRAINWISE_S3_BUCKET)"
            )
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    def _full_key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full_key(key)}"

    def put_file(self, local_path: Path, key: str) -> str:
        self.client.upload_file(
            str(local_path), self.bucket, self._full_key(key),
            ExtraArgs={"Metadata": {"sha256": sha256_of(Path(local_path))}},
        )
        return self.uri(key)

    def get_file(self, key: str, local_path: Path) -> Path:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        self.client.download_file(self.bucket, self._full_key(key), str(local_path))
        return Path(local_path)

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._full_key(key))
        except Exception as error:  # botocore ClientError 404: keep botocore out of imports
            if "404" in str(error) or "Not Found" in str(error):
                return False
            raise
        return True
