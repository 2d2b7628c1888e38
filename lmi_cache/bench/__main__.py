"""Entry point for ``python -m lmi_cache.bench`` (same command as ``lmi-cache bench``)."""
from __future__ import annotations

from lmi_cache.bench.cli import main

if __name__ == "__main__":
    main()
