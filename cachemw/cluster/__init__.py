"""What ties the nodes together: the Ray actor that is each node's daemon, names in Ray,
peers and key ownership, owner-side fills for other nodes, and the block server that sends
cached blocks to other nodes' readers. The only part of cachemw that imports Ray.
"""
