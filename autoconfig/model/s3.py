"""``option.model_id=s3://bucket/prefix/``: the model copied from S3 before vLLM starts, as LMI does.

Run by ``lmi-cache serve`` in the container-start process. LMI downloads an
S3 model prefix to local disk and serves from there (its integration tests
and user guides write ``option.model_id=s3://...``); so do we, into the
private runtime directory (``<runtime>/s3-models/<hash of the URI>``), with
boto3 (the ``s3`` extra) and the container's AWS credentials. An object
already there with the same size is not fetched again (a restarted container).
``fetch_config`` fetches only ``config.json`` (``serve --dry-run`` plans with it).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from lmi_cache.errors import UserError

S3_SCHEME = "s3://"


class S3ModelError(UserError):
    """The S3 model location can't be read (names the option and what to do)."""


def is_s3(uri: str) -> bool:
    return uri.startswith(S3_SCHEME)


def split_uri(uri: str, where: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> (``bucket``, ``a/b/``): the prefix always ends with ``/`` (or is empty)."""
    bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise S3ModelError(f"{where}={uri}: expected s3://bucket/prefix/")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


def local_dir(runtime_dir: Path, uri: str) -> Path:
    """Where the model of ``uri`` is kept (stable across restarts of the container)."""
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return runtime_dir / "s3-models" / digest


def download(uri: str, target: Path, where: str, *, client: Any = None,
             echo: Callable[[str], None] = print) -> Path:
    """Copy every object under the prefix into ``target`` (a directory we own); return ``target``."""
    bucket, prefix = split_uri(uri, where)
    client = client or _client(where)
    objects = _list(client, bucket, prefix, uri, where)
    total = sum(size for _, size in objects)
    echo(f"downloading {uri} ({len(objects)} files, {total / (1 << 30):.2f} GiB) to {target}")
    for key, size in objects:
        rel = key[len(prefix):]
        if not rel or rel.endswith("/"):
            continue
        dest = target / rel
        if ".." in Path(rel).parts or not dest.resolve().is_relative_to(target.resolve()):
            raise S3ModelError(f"{where}={uri}: object {key!r} would land outside the model directory")
        if dest.is_file() and dest.stat().st_size == size:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = dest.with_name(dest.name + ".partial")
        try:
            client.download_file(bucket, key, str(partial))
        except Exception as err:  # botocore errors: one line for the user
            partial.unlink(missing_ok=True)
            raise S3ModelError(f"{where}={uri}: cannot download {key} ({_one_line(err)})") from None
        os.replace(partial, dest)
    return target


def fetch_config(uri: str, target: Path, where: str, *, client: Any = None) -> Path:
    """Only ``config.json`` of the model, into ``target``; return ``target``."""
    bucket, prefix = split_uri(uri, where)
    client = client or _client(where)
    try:
        client.download_file(bucket, prefix + "config.json", str(target / "config.json"))
    except Exception as err:
        raise S3ModelError(f"{where}={uri}: cannot read {prefix}config.json ({_one_line(err)}); check the "
                           "prefix and the container's S3 permissions") from None
    return target


def materialize_s3_model(uri: str, where: str, runtime_dir: Path, dry_run: bool,
                         scratch: ExitStack) -> tuple[str, str]:
    """(what vLLM's --model gets, where config.json can be read now) for an s3:// model id.

    A real start copies the model into the private runtime directory first; a
    dry run fetches only config.json into a scratch directory ``scratch`` removes.
    """
    from lmi_cache.private_dir import UnsafeDirectoryError, ensure_private_dir, private_dir_problem

    target = local_dir(runtime_dir, uri)
    if dry_run:
        problem = private_dir_problem(runtime_dir)
        if problem:
            raise S3ModelError(f"runtime directory (LMI_CACHE_RUNTIME_DIR): {problem}")
        tmp = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="lmi-cache-s3-config-")))
        return str(target), str(fetch_config(uri, tmp, where))
    try:
        ensure_private_dir(runtime_dir)
        ensure_private_dir(target)
    except UnsafeDirectoryError as err:
        raise S3ModelError(f"runtime directory (LMI_CACHE_RUNTIME_DIR): {err}") from None
    download(uri, target, where)
    return str(target), str(target)


def _list(client: Any, bucket: str, prefix: str, uri: str, where: str) -> list[tuple[str, int]]:
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        objects = [(o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", [])]
    except Exception as err:
        raise S3ModelError(f"{where}={uri}: cannot list it ({_one_line(err)}); check the bucket, the prefix "
                           "and the container's S3 permissions") from None
    if not any(key == prefix + "config.json" for key, _ in objects):
        raise S3ModelError(f"{where}={uri}: no config.json under this prefix; point it at the model's folder")
    return objects


def _client(where: str) -> Any:
    try:
        import boto3
    except ImportError:
        raise S3ModelError(f"{where}: an s3:// model needs boto3: pip install 'lmi-cache[s3]'") from None
    return boto3.client("s3")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__
