"""The persistent disk tier: index, files, rank directories, reads, free-space budget, trust checks (torch-free)."""
