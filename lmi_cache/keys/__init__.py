"""Chunk keys: token ids -> prefix-chained keys, the chunk object format, the model identity in the key namespace (torch-free)."""
