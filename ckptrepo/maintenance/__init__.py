"""Keeping a repository healthy: retention and garbage collection, fsck, disk usage.
"""

__all__: list[str] = []
