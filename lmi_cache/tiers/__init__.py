"""Storage tiers of the cache engine (worker process).

Importing this package is torch-free: the disk tier works on plain buffers
(numpy), only the CPU tier imports torch. Use ``tiers.factory`` to build them.
"""
from __future__ import annotations
