"""Fixtures for tests that need a real redis-server (throwaway, on a free port)."""
