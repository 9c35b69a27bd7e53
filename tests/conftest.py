"""Shared fixtures. Test helpers live here, never inside the package."""
from __future__ import annotations
