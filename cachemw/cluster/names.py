"""Where the daemons are found in Ray: one detached actor per node, named after the node,
in a namespace of their own (so any driver of the cluster finds them by name)."""

NAMESPACE = "cachemw"
ACTOR_PREFIX = "cachemw-daemon-"


def actor_name(node_id: str) -> str:
    return ACTOR_PREFIX + node_id
