"""The load path: one read engine (plan the byte ranges, read, verify, scatter) behind plain loads,
in-place loads and loads into any parallel layout.
"""

__all__: list[str] = []
