"""What runs inside the trainer and its DataLoader workers: the fsspec filesystem, the block
reader, the link to the node daemon, fills written behind reads, metadata, and direct reads
from other nodes' block servers.

Never imports Ray, nor the daemon's internals (``cachemw.node``, ``cachemw.cluster``): a
forked DataLoader worker cannot use its parent's Ray connection, and a hit must cost a file
read, not a round trip.
"""
