"""The plan: (host snapshot, model geometry, serving settings) -> tier sizes, each number with its reason; starts vLLM would refuse (pure)."""
