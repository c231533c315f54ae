"""Fixtures for tests that need a real PostgreSQL (a database created and dropped per session)."""
