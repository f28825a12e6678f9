"""Looking at history: diff, statistics and trajectories, the log graph, plots, export and import.
"""

__all__: list[str] = []
