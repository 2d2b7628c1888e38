"""The model: where its config.json is, its KV geometry and parameter count as vLLM 0.32 sees them (torch-free)."""
