"""The lmi_cache_* Prometheus series, where they are published, and the per-process exporters."""
