"""Paged attention: metadata, backends (the pure-torch reference first)."""
