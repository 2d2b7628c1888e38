"""Placement: the scheduler's one record of which chunk is in which tier, and its decisions (torch-free).

``directory.PlacementDirectory`` owns it; ``book.TierBook`` is one tier's page;
``messages`` holds the instructions and reports that cross to the workers;
``startup`` builds the directory from the cache config and the disk tier's files.
"""
