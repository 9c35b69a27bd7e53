"""``python -m cachemw.dlio``: print the config dir of the shipped DLIO workloads (for
``dlio_benchmark --config-dir``)."""
from cachemw.dlio import CONFIG_DIR

print(CONFIG_DIR)
