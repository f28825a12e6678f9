"""Parallel layouts: TP/PP/DP/ZeRO layouts, sharding rules, the mapping of local state to global pieces,
replica fingerprints, and the distributed two-phase commit.
"""

__all__: list[str] = []
