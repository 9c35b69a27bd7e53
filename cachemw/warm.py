"""``cachemw warm``: read a dataset into the cache before training, on one node or on every
node of a job at once.

On several nodes together (``srun -N $SLURM_JOB_NUM_NODES --ntasks-per-node=1 cachemw warm
URL``; inside a Slurm step the step's node count is the default of ``--nodes``), each node
reads only the blocks its node owns on the ring, so each block is fetched from the source
once for the whole allocation, by its owner, and all nodes fetch at the same time. The ring
is the one the node's daemon routes misses by (its ``ring`` op: no Ray in the warm). Every
node must see a cache cluster of exactly as many nodes as warm together, or the warm fails
before it reads anything: a node left out would leave its share cold without a word.

Alone (``--nodes 1`` given, or a daemon that is no cluster: autostarted, or site mode's
node-local one; a one-node Slurm step in a cluster of several is refused without it, as
any step of fewer nodes than the cluster is), a node reads everything; blocks owned by other nodes are fetched from the
source by their owners and sent here, as for any read. A daemon that is no cluster is a
cache of one node: ``--nodes N`` (N > 1) given against it is refused as any cluster of
another size is; the nodes of a Slurm step (its node count the default) each warm
everything for themselves.

A warm returns no bytes to anyone: it fills the tiers through the path every read takes
(leases, fills pinned to the version listed, checksummed block files), so a failure midway
(a source error, a file changed or gone, the daemon lost) leaves whole, verified blocks of
the version read and nothing else. What was not cached is counted and said, and the exit
status says it (``run`` returns a Report; the CLI maps it).
"""
from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec

from .client import finding
from .client.metadata import FileMeta
from .client.wire import DaemonUnavailable
from .config import WarmConfig
from .config_values import format_size
from .keys import block_count, block_key, block_length
from .launch import START_WAIT, await_address, spawn_detached
from .protocol import lock_holder, lookup
from .ring import HashRing
from .store_errors import store_failed
from .tiers.pinning import source_info

BATCH_BLOCKS = 64  # block reads handed to the cache at once (one lease request per batch),
BATCH_BYTES = 32 << 20  # at most; fewer when that gives each thread several batches (the
BATCHES_PER_THREAD = 4  # blocks of one batch are fetched one after the other)
UNCACHED = ("fallbacks", "bypassed", "fill_errors")  # client counters of reads not cached


class WarmError(RuntimeError):
    """The warm cannot run as asked (nothing was read)."""


@dataclass(frozen=True)
class Share:
    """Which blocks this node warms: all of them (``ring`` None), or those it owns."""

    node: str  # this node's name on the ring, else its hostname
    nodes: int  # how many nodes warm together
    ring: HashRing | None = None
    members: tuple[str, ...] = ()

    def mine(self, key: str) -> bool:
        return self.ring is None or self.ring.owner(key) == self.node


@dataclass
class Report:
    node: str  # its name on the ring
    nodes: int
    host: str = field(default_factory=socket.gethostname)
    files: int = 0
    blocks: int = 0  # blocks this node had to warm (its share)
    bytes: int = 0
    seconds: float = 0.0
    counters: dict = field(default_factory=dict)  # this process's client counters
    errors: dict = field(default_factory=dict)  # path -> why it was not read
    notes: list = field(default_factory=list)  # what else kept blocks out of the cache
    skipped: str | None = None  # why this task had nothing to do

    @property
    def ok(self) -> bool:
        return not self.errors and not self.notes

    def as_dict(self) -> dict:
        """The report as ``--json`` prints it: one line, the counters that moved only (kept
        short: srun may cut a long line of one task into another's)."""
        return {"node": self.node, "host": self.host, "nodes": self.nodes, "files": self.files,
                "blocks": self.blocks, "bytes": self.bytes, "seconds": self.seconds,
                "counters": {k: v for k, v in self.counters.items() if v},
                "errors": self.errors, "notes": self.notes, "skipped": self.skipped,
                "ok": self.ok}

    def summary(self) -> str:
        if self.skipped:
            return f"{self.node}: nothing to do ({self.skipped})"
        c = self.counters
        share = "" if self.nodes == 1 else f" (its share, {self.nodes} nodes)"
        verb = "warmed" if self.ok else "read (not all of it cached: see below)"
        line = (f"{self.node}: {verb} {format_size(self.bytes)} in {self.blocks} blocks of "
                f"{self.files} files{share} in {self.seconds:.1f} s: "
                f"{c.get('misses', 0) + c.get('bypassed', 0) + c.get('fallbacks', 0)} "
                f"fetched from the source, "
                f"{c.get('hits', 0) + c.get('remote_hits', 0)} cached already")
        if c.get("remote_reads"):
            line += f", {c['remote_reads']} fetched by their owner nodes"
        return line


def open_url(url: str, runtime_dir: str | None = None):
    """(cachemw filesystem, path) of a ``cachemw::`` URL, any fsspec URL or a local path;
    ``runtime_dir`` (the CLI's ``--runtime-dir``) names the cache to warm, else the
    filesystem's own default (``CACHEMW_RUNTIME_DIR``, then the per-user one)."""
    if "://" not in url and "::" not in url:  # a path; cachemw:// URLs are absolute
        url = f"cachemw://{os.path.abspath(url)}"
    elif not url.startswith("cachemw:"):
        url = f"cachemw::{url}"
    # the cachemw layer is always the URL's first: unkeyed options are its own
    return fsspec.core.url_to_fs(url, **({} if runtime_dir is None else
                                          {"runtime_dir": runtime_dir}))


def ensure_daemon(fs) -> None:
    """A daemon to warm into. One this process autostarted would end with it (and free its
    DRAM tier): with none running, start one that outlives the warm (it exits after 10
    idle minutes, as one started by a DataLoader worker does); one that replaces it during
    the warm outlives it too (_warm runs under finding.daemons_outlive)."""
    runtime_dir = fs.options.runtime_dir
    restarting = None  # a Ray-managed daemon that died: Ray restarts it (in about a second)
    if lock_holder(runtime_dir) is None:
        address = lookup(runtime_dir)
        if address is not None and address.kind == "ray":
            restarting = address
            deadline = time.monotonic() + START_WAIT
            while lock_holder(runtime_dir) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            await_address(runtime_dir, max(0.0, deadline - time.monotonic()))
        elif fs.options.autostart:
            spawn_detached(runtime_dir, fs.client.daemon_config, wait=START_WAIT)
    if not fs.client.connected():
        if restarting is not None:
            raise WarmError(f"no cachemw daemon answers in {runtime_dir}: the one `cachemw "
                            f"start` placed here (pid {restarting.pid}) is gone, and Ray has "
                            f"not restarted it within {START_WAIT:.0f} s (see `cachemw status` "
                            f"and the daemon's log)")
        raise WarmError(f"no cachemw daemon answers in {runtime_dir}: a warm without one "
                        f"caches nothing (start one with `cachemw start`, or inside a Slurm "
                        f"job use slurm/cachemw-job.sh)")


def node_share(client, config: WarmConfig, *, poll: float = 0.5) -> Share:
    """This node's share, from its daemon's view of the ring. With several nodes warming
    together, waits (``ring_wait``) until the daemon's ring holds every alive node of its
    cluster, then checks that they are as many as the nodes warming; a ring already formed
    of more alive nodes than that is refused at once (nodes that join cannot make it fit)."""
    host = socket.gethostname()
    deadline = time.monotonic() + config.ring_wait
    while True:
        try:
            d = client.ring(strict=True)
        except DaemonUnavailable as exc:
            if config.nodes == 1:  # alone either way: it reads everything (misses fall back)
                return Share(host, 1)
            if time.monotonic() >= deadline:  # which blocks are this node's is unknown
                raise WarmError(f"this node's cache daemon did not answer for "
                                f"{config.ring_wait:.0f} s ({exc}), so which blocks this node "
                                f"owns is unknown; see `cachemw status` and its log") from None
            time.sleep(poll)
            continue
        if d is None:  # no cluster (autostarted, or site mode's node-local daemon): a ring of one
            if config.nodes > 1 and config.alone_ok:  # --nodes N given: not this cache's size
                raise WarmError(_other_size(config, 1, "a daemon of this node alone, "
                                                       "autostarted or node-local"))
            return Share(host, 1)  # alone, or each node of a Slurm step for itself (site mode)
        members = tuple(d["members"])
        alive = d.get("alive", len(members))
        formed = len(members) >= alive
        if config.nodes == 1 and (config.alone_ok or (formed and len(members) == 1)):  # alone
            return Share(d["self"], config.nodes)
        if formed and len(members) == config.nodes:
            return Share(d["self"], config.nodes, HashRing(members, d["vnodes"]), members)
        if formed and alive > config.nodes:  # more nodes than warm: no wait can change it
            raise WarmError(_other_size(config, len(members), f"complete; {alive} alive"))
        if time.monotonic() >= deadline:
            break
        time.sleep(poll)
    seen = "still forming" if not formed else "complete"
    raise WarmError(_other_size(config, len(members), f"{seen} after {config.ring_wait:.0f} "
                                                      f"s; {d.get('alive', '?')} alive"))


def _other_size(config: WarmConfig, members: int, why: str) -> str:
    """Why a warm on ``config.nodes`` nodes cannot run on a cache cluster of ``members``."""
    return (f"this warm runs on {config.nodes} nodes at once, but the cache cluster this "
            f"node's daemon sees has {members} node(s) ({why}): each node warms only the "
            f"blocks it owns, so the nodes warming must be the cluster's nodes, one task each "
            f"(srun -N $SLURM_JOB_NUM_NODES --ntasks-per-node=1 cachemw warm ...), or give "
            f"--nodes 1 to warm everything from one node")


def plan(metas: list[FileMeta], share: Share, block_size: int) -> list[tuple[FileMeta, int, int]]:
    """The block ranges of ``metas`` this node warms: (file, start, end) per block."""
    out = []
    for meta in metas:
        for i in range(block_count(meta.size, block_size) if meta.size > 0 else 0):
            if share.mine(block_key(meta.url, meta.version, i, block_size)):
                start = i * block_size
                out.append((meta, start, start + block_length(meta.size, i, block_size)))
    return out


def batches(pieces: list[tuple[FileMeta, int, int]],
            threads: int = 1) -> list[list[tuple[FileMeta, int, int]]]:
    """``pieces`` in batches: each batch's misses go to the daemon in one request and are
    fetched one after the other, so there are enough batches to keep ``threads`` busy."""
    most = max(1, min(BATCH_BLOCKS, -(-len(pieces) // (threads * BATCHES_PER_THREAD))))
    out, batch, size = [], [], 0
    for piece in pieces:
        if batch and (len(batch) >= most or size + piece[2] - piece[1] > BATCH_BYTES):
            out.append(batch)
            batch, size = [], 0
        batch.append(piece)
        size += piece[2] - piece[1]
    if batch:
        out.append(batch)
    return out


def _read_batch(fs, batch, errors: dict) -> int:
    """Read one batch through the cache; returns the bytes read. A range that fails is
    recorded in ``errors`` (its file's first error) and the others go on: a batch that
    fails as a whole (a file gone under it) is read again range by range, to tell which."""
    paths = [m.path for m, _, _ in batch]
    starts = [s for _, s, _ in batch]
    ends = [e for _, _, e in batch]
    try:
        results = fs.cat_ranges(paths, starts, ends, on_error="return")
    except OSError:
        results = []
        for p, s, e in zip(paths, starts, ends):
            try:
                results.append(fs.cat_file(p, s, e))
            except OSError as exc:
                results.append(exc)
    done = 0
    for path, got in zip(paths, results):
        if isinstance(got, BaseException):
            errors.setdefault(path, f"{type(got).__name__}: {got}")
        else:
            done += len(got)
    return done


def _missing(target, path: str) -> bool:
    """Is ``path`` known missing, asked of the store itself (not through the cache, which
    would start a daemon that ends with this process, before ensure_daemon starts one that
    outlives it)? Another error is the listing's to say. Asked as a read asks it
    (source_info): fsspec's HTTP ``info`` calls a server that does not answer "not found"."""
    try:
        source_info(target, path)
    except FileNotFoundError:
        return True
    except Exception:  # noqa: BLE001 - e.g. no credentials: _listed names it
        return False
    return False


def _to_list(info: dict) -> bool:
    """Is what ``info`` describes listed for the files under it? A directory is, and so is
    an HTTP URL its server says is HTML (a directory's index, whose links are its files:
    fsspec's HTTP filesystem calls every URL a file). Any other file is only itself: a
    listing of it over HTTP GETs its whole body looking for links, on every node warming,
    on top of its owner's block reads."""
    return info.get("type") == "directory" or info.get("mimetype") == "text/html"


def _listed(url: str, fs, path: str, errors: dict) -> list[FileMeta]:
    """The files under ``url`` (or the file itself, not listed: _to_list), with their
    metadata; a file whose metadata cannot be had is recorded in ``errors``. A store that fails the listing (its
    client's error, say botocore's NoCredentialsError, as the OSError cachemw raises for it:
    store_errors.py store_failed) is a WarmError naming it: nothing has been read yet, and
    its traceback would say less."""
    metas = []
    try:
        try:
            info = fs.info(path)
        except FileNotFoundError:
            errors[url] = f"FileNotFoundError: {url}: no such file or directory"
            return metas
        found = sorted(fs.find(path)) if _to_list(info) else [path]
        for p in found:
            try:
                metas.append(fs.meta.file(p))
            except OSError as exc:
                errors[p] = f"{type(exc).__name__}: {exc}"
    except OSError as exc:
        if not store_failed(exc):
            raise
        raise WarmError(f"cannot list {url}: {exc}") from exc
    except Exception as exc:
        raise WarmError(f"cannot list {url}: {type(exc).__name__}: {exc}") from exc
    return metas


def run(urls: list[str], config: WarmConfig, *, progress=None,
        runtime_dir: str | None = None) -> Report:
    """Warm ``urls`` (files or directories) on this node: its share when several nodes
    warm together, into the cache of ``runtime_dir`` (None: the filesystem's default).
    ``progress(done_bytes, total_bytes)`` is called as batches complete."""
    opened = [(url, *open_url(url, runtime_dir)) for url in urls]
    # a warm's reads of blocks other nodes own are no reads of this node's: reported, they
    # had the daemon copy every block the second warm read (replication, cluster/owner.py)
    clients = list({id(fs.client): fs.client for _, fs, _ in opened}.values())
    reported = [(client, client.report_remote_hits) for client in clients]
    for client in clients:
        client.report_remote_hits = False
    try:
        return _warm(opened, config, progress)
    finally:
        for client, was in reported:
            client.report_remote_hits = was


def _warm(opened: list, config: WarmConfig, progress) -> Report:
    """``run`` of the opened URLs."""
    with finding.daemons_outlive():
        return _warm_outliving(opened, config, progress)


def _warm_outliving(opened: list, config: WarmConfig, progress) -> Report:
    fs0 = opened[0][1]
    if config.local_task > 0:  # one task per node does the node's work
        return Report(socket.gethostname(), config.nodes, skipped=(
            f"task {config.local_task} of its node: the node's first task warms it"))
    missing = [url for url, fs, path in opened if _missing(fs.target, fs._strip_protocol(path))]
    if len(missing) == len(opened):  # a bad argument: no daemon started for nothing
        raise WarmError(f"nothing to warm: not found at the store: {', '.join(missing)}")
    ensure_daemon(fs0)
    share = node_share(fs0.client, config)
    report = Report(share.node, share.nodes)
    started = time.monotonic()
    work = []
    for url, fs, path in opened:
        metas = _listed(url, fs, path, report.errors)
        report.files += len(metas)
        pieces = plan(metas, share, fs.options.block_size)
        work += [(fs, b) for b in batches(pieces, config.threads)]
        report.blocks += len(pieces)
    filesystems = list({id(fs): fs for _, fs, _ in opened}.values())
    before = {id(fs): dict(fs.stats()) for fs in filesystems}
    total = sum(e - s for _, b in work for _, s, e in b)
    done = 0
    if progress is not None:
        progress(0, total)
    with ThreadPoolExecutor(config.threads, thread_name_prefix="cachemw-warm") as pool:
        sizes = [sum(e - s for _, s, e in b) for _, b in work]
        for size, read in zip(sizes, pool.map(lambda w: _read_batch(*w, report.errors), work)):
            done += size
            report.bytes += read
            if progress is not None:
                progress(done, total)
    for fs in filesystems:  # every fill written into the tiers, every tally to the daemon
        after = fs.stats()
        fs.client.flush()
        for k, v in after.items():
            report.counters[k] = report.counters.get(k, 0) + v - before[id(fs)].get(k, 0)
    report.seconds = time.monotonic() - started
    uncached = {k: report.counters.get(k, 0) for k in UNCACHED if report.counters.get(k, 0)}
    if uncached:
        report.notes.append(
            "read but not cached: " + ", ".join(f"{n} {k}" for k, n in uncached.items())
            + " (daemon unreachable, tiers full, or fills failed: `cachemw stats` and the "
            "daemon's log say which)")
    if share.ring is not None:
        try:
            d = fs0.client.ring(strict=True)
        except DaemonUnavailable:
            d = {"members": share.members}  # not asked again: nothing says it changed
        now = tuple(d["members"]) if d else ()
        if now != share.members:
            report.notes.append(
                f"the cache cluster changed during the warm ({len(share.members)} -> "
                f"{len(now)} nodes): the share of a node that left or joined may be cold; "
                f"warm again")
    return report


def progress_printer(node: str, stream=None):
    """One progress display per node: a bar on a terminal, else a line per tenth (srun
    gathers every node's output into one stream: lines stay whole)."""
    stream = stream or sys.stderr
    if stream.isatty():
        from tqdm import tqdm

        bar = None

        def show(done, total):
            nonlocal bar
            if bar is None:
                bar = tqdm(total=total, desc=node, unit="B", unit_scale=True, file=stream)
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
        return show
    state = {"next": 0.0, "t": time.monotonic()}

    def lines(done, total):
        frac = done / total if total else 1.0
        if frac >= state["next"]:
            print(f"{node}: {frac:4.0%} of {format_size(total)} "
                  f"({time.monotonic() - state['t']:.1f} s)", file=stream, flush=True)
            state["next"] = min(1.0, int(frac * 10 + 1) / 10)
            if frac >= 1.0:
                state["next"] = 2.0
    return lines
