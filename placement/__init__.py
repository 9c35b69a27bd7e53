"""Placement engine: pure placement policies and a trace simulator (see issue 4)."""
