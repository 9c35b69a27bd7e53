"""The node daemon's body: the node cache and its records, moves between tiers and prefetch,
the placer that feeds the placement engine, the socket server clients talk to, and the
service process that holds them (``python -m cachemw.node.service``).

Testable without Ray: the Ray actor (``cachemw.cluster``) wraps a NodeService.
"""
