"""The save path: coalescing plans, the staging pool, lazy asynchronous capture, dedup and the commit.
"""

__all__: list[str] = []
