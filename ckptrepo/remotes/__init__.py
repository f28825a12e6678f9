"""Remotes: push, fetch, pull and clone between repositories, and local retention after a push."""
