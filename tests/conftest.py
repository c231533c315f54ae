"""Fixtures shared by the whole suite live in the plugin modules listed here."""

pytest_plugins = [
    "tests.fixtures_redis",
    "tests.fixtures_postgres",
]
