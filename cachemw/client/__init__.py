"""What runs inside the trainer and its DataLoader workers: the fsspec filesystem, the block
reader, the link to the node daemon, fills written behind reads, metadata, and direct reads
from other nodes' block servers.

Never imports Ray, nor the daemon's internals (``cachemw.node``, ``cachemw.cluster``): a
forked DataLoader worker cannot use its parent's Ray connection, and a hit must cost a file
read, not a round trip.

A worker that imports the client (a dataset of plain ``cachemw::`` URLs, whose main process
never did) first freezes what it inherited, ``gc.freeze()``: the import allocates a few
thousand objects, and a forked worker typically starts one or two young collections short of
a full one, which walks every object of the trainer's heap and writes to each (so the kernel
copies every page of it): 100-125 ms per worker per epoch here. Frozen objects are never
examined again; in a worker they are the parent's, shared with it, so freezing them costs
no memory and saves the copies (Python's documentation recommends it for forked workers).
``CACHEMW_GC_FREEZE=0`` turns it off.
"""
from __future__ import annotations

import gc
import multiprocessing

from ..config import freeze_gc_in_workers

if multiprocessing.parent_process() is not None and gc.isenabled() and freeze_gc_in_workers():
    gc.freeze()
