"""Placement engine (provisional docstring)."""
from .simulator import SimResult, simulate
