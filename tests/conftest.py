"""Shared pytest setup: makes ``tests/harness`` importable as ``harness``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
