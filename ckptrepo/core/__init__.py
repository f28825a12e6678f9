"""The repository's model: the manifest schema, refs and revisions, and the version history.

Built on storage/; everything above reads and writes versions through it.
"""

__all__: list[str] = []
