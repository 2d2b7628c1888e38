"""``lmi-cache bench``: workload generator and TTFT benchmark for OpenAI-compatible servers.

Runs in its own (client) process against any server, vLLM with our connector,
LMCache or none. Import stays light: aiohttp and click load with the modules
that need them (``client``, ``cli``), not here.
"""
from __future__ import annotations
