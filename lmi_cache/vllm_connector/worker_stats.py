"""One rank's connector counts (vLLM worker process): shared by the worker side and its chunk loads."""
from __future__ import annotations

from lmi_cache.metrics.counts import Count, RankCounts


class WorkerStats(RankCounts):
    """This rank's connector counts, each the rank's ``lmi_cache_worker_*`` series (``metrics.counts``)."""

    what = "worker metrics"
    num_chunks_loaded = Count("lmi_cache_worker_loaded_chunks", "Chunks copied into vLLM's KV cache")
    num_chunks_saved = Count("lmi_cache_worker_saved_chunks", "Chunks gathered after forward passes and stored")
    num_saves_refused = Count("lmi_cache_worker_refused_saves", "Chunks the engine refused to store (no room)")
    num_load_faults = Count("lmi_cache_worker_load_faults", "Planned chunks that did not land (vLLM recomputes them)")
    num_save_faults = Count("lmi_cache_worker_save_faults", "Chunks whose gather or store failed (a future miss)")
    load_bytes = Count("lmi_cache_worker_loaded_bytes", "KV bytes copied into vLLM's KV cache by loads")
    # The connector's own time on vLLM's model thread, which no tier series shows (a save's gather and a
    # load's wait for its reads and copies happen between forward passes).
    load_seconds = Count("lmi_cache_worker_load_seconds",
                         "Seconds the model thread spent reading hits and copying them into vLLM's KV cache")
    save_seconds = Count("lmi_cache_worker_save_seconds",
                         "Seconds the model thread spent gathering and storing chunks after forward passes")
