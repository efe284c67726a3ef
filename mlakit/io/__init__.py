"""Disk and hub IO of a conversion: opening sources, writing shards, the work directory and publishing outputs."""
