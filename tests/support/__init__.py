"""Helpers the tests share (no tests here): fakes, references, servers, chart rendering.

Tests import them as `from support.<module> import ...`; tests/conftest.py puts tests/ on
sys.path, so this works from any folder under tests/ and from drivers run as scripts."""
