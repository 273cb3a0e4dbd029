"""Shared-memory rings for arrays that cross processes every step."""
