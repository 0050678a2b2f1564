"""Data sources and the sharded, resumable loader."""
