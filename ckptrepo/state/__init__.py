"""Training states as data: flattening a state into a skeleton plus tensor records, and reading skeletons.
"""

__all__: list[str] = []
