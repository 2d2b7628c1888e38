"""The cache configuration: LMCache-format YAML plus LMCACHE_* env, typed and validated (torch-free, any process)."""
