"""Storage tiers: one module per tier behind the small protocol in base.py."""
