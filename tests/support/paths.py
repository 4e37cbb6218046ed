"""Where things are, for tests in any folder: the repository, the tests, these helpers (the
worker scripts among them, started by path), the golden chains and the spec."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
GOLDEN = TESTS / "golden"
SPEC = REPO / "spec"
EXAMPLES = REPO / "examples"
