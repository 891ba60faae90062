"""Shared fixtures: tiny real models built offline once per session (see rollmatch.models.tiny)."""
