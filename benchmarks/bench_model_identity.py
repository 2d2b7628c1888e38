"""Cost of the model identity fingerprint against reading the weights once (run by hand; test-free).

Writes a model directory with one real weight file of ``--gib`` GiB of random
bytes plus a sparse ``--sparse-gib`` GiB file, then times, side by side:

- the fingerprint (``lmi_cache.keys.model_identity.content_fingerprint``), with the
  weight files dropped from the page cache first (cold) and again warm;
- the baseline: hashing every byte of the same files once (what a naive
  content hash costs), cold.

"Cold" uses posix_fadvise(DONTNEED), which drops clean cached pages of a file
without privileges. Usage::

    .venv/bin/python benchmarks/bench_model_identity.py --gib 2 --sparse-gib 16
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import xxhash

from lmi_cache.keys.model_identity import content_fingerprint


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages can't be dropped: write them out first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def full_hash(paths: list[Path]) -> str:
    digest = xxhash.xxh3_128()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while block := handle.read(16 << 20):
                digest.update(block)
    return digest.hexdigest()


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the real weight file")
    parser.add_argument("--sparse-gib", type=float, default=16.0, help="size of the sparse weight file")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = Path(tmp)
        (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        real = model / "model-00001-of-00002.safetensors"
        with open(real, "wb") as handle:
            block = os.urandom(16 << 20)
            for _ in range(int(args.gib * 1024 / 16)):
                handle.write(block)
        sparse = model / "model-00002-of-00002.safetensors"
        with open(sparse, "wb") as handle:
            handle.truncate(int(args.sparse_gib * 1024**3))
        for path in (real, sparse):
            drop_cache(path)
        cold = timed(lambda: content_fingerprint(model))
        warm = timed(lambda: content_fingerprint(model))
        for path in (real, sparse):
            drop_cache(path)
        baseline = timed(lambda: full_hash([real, sparse]))
        total_gib = args.gib + args.sparse_gib
        print(f"weights: {args.gib:g} GiB real + {args.sparse_gib:g} GiB sparse = {total_gib:g} GiB in 2 files")
        print(f"fingerprint cold: {cold * 1000:.1f} ms   warm: {warm * 1000:.2f} ms")
        print(f"baseline (hash every byte once, cold): {baseline:.2f} s")
        print(f"fingerprint cold / baseline: {cold / baseline:.5f}x  ({baseline / cold:.0f}x faster)")


if __name__ == "__main__":
    main()
