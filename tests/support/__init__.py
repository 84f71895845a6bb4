"""Helpers shared by the test suites (import as ``from tests.support import ...``; pytest runs
from the repository root, which ``python -m pytest`` puts on sys.path)."""
