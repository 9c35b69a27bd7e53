"""The emulated PFS: an HTTP server over a local directory, in a process of its own, that
answers like a busy shared store seen from one node.

Why HTTP: every reader on the machine (DataLoader workers, the cache daemon, the
prefetcher) reaches it through real sockets, with fsspec's own HTTP filesystem
(``http://127.0.0.1:PORT/...``, ``cachemw::http://...``), so nothing in the job reads the
dataset's directory behind the store's back, and its limits hold for all of them at once.

What it emulates (``StoreProfile``):

- ``latency``: each data request (GET of a file or a range, PUT) waits this long before
  its first byte, as a PFS read RPC or an object-store GET does; requests in flight at
  the same time wait side by side, not one after the other.
- ``bandwidth``: bytes per second shared by every request of every process and
  connection, reads and writes alike: one link, one token bucket in the server. Bytes go
  out in 64 KiB pieces, each reserving its slot on the link, so concurrent transfers
  share it fairly.
- ``meta_latency``: each metadata request (HEAD, a directory listing, mkdir, rename,
  delete) waits this long.

It speaks what cachemw's HTTP source needs to pin a read to one version of a file
(cachemw/tiers/source.py): a strong ETag per file (size, mtime and inode), ``Range``
(206), ``If-Match`` (412 when the file has another ETag). Writes (for checkpoints, through
``storefs.StoreFileSystem``): ``PUT`` (written under a temp name, fsynced, renamed),
``DELETE``, ``POST ?op=mkdir``, ``POST ?op=mv&to=PATH``; ``GET DIR?list=json`` lists with
sizes. ``GET /_store/stats`` returns request and byte counters and the most requests seen
in flight at once (no latency).

Run: ``python -m cachemw.job.store --root DIR [--port 0] [--latency-ms 10] ...``; it prints
``listening on http://HOST:PORT`` and exits when its standard input closes (so it never
outlives the job that started it), or on SIGTERM. ``EmulatedStore`` does all that.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import html
import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid

from aiohttp import web

from .settings import StoreProfile

PIECE = 64 * 1024  # bytes per reservation on the shared link
STATS_PATH = "/_store/stats"


def etag_of(st: os.stat_result) -> str:
    """A strong ETag that changes with the file's size, mtime or inode (a replaced file)."""
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"'


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> ``(start, end)`` exclusive; None for no
    header; ValueError for a range the file cannot satisfy (or several ranges)."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        raise ValueError(header)
    first, _, last = spec.strip().partition("-")
    if first == "":
        n = int(last)
        start, end = max(0, size - n), size
    else:
        start = int(first)
        end = size if last == "" else min(size, int(last) + 1)
    if start >= size or end <= start:
        raise ValueError(header)
    return start, end


class Link:
    """The store's bandwidth: every piece of every transfer reserves its time on it (a
    single asyncio loop, so a reservation is atomic).

    A piece waits only once its reservation runs more than ``SLACK`` ahead of the clock, and
    an idle link keeps ``SLACK`` of credit: the event loop sleeps in whole milliseconds, so
    sleeping for each 64 KiB piece (0.3 ms at 200 MiB/s) would cap one transfer at a piece
    per millisecond. Over any interval T the link carries at most rate x (T + 2 x SLACK)."""

    SLACK = 0.002

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0

    async def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        now = asyncio.get_running_loop().time()
        self.free_at = max(now - self.SLACK, self.free_at) + nbytes / self.rate
        if self.free_at - now > self.SLACK:
            await asyncio.sleep(self.free_at - now)


class Store:
    """The request handlers (aiohttp), over ``root``."""

    def __init__(self, root: str, profile: StoreProfile) -> None:
        self.root = os.path.realpath(root)
        self.profile = profile
        self.link = Link(profile.bandwidth)
        self.counts = {k: 0 for k in ("get", "get_range", "head", "list", "put", "delete",
                                      "mkdir", "mv", "precondition_failed", "not_found",
                                      "aborted", "cut_short")}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.in_flight = {"data": 0, "meta": 0}
        self.peak_in_flight = {"data": 0, "meta": 0}

    # -- helpers ---------------------------------------------------------------------

    def local(self, url_path: str) -> str:
        """The file under root that ``url_path`` names; PermissionError if outside it."""
        rel = url_path.lstrip("/")
        path = os.path.realpath(os.path.join(self.root, rel))
        if path != self.root and not path.startswith(self.root + os.sep):
            raise PermissionError(url_path)
        return path

    async def meta_wait(self) -> None:
        if self.profile.meta_latency:
            await asyncio.sleep(self.profile.meta_latency)

    async def data_wait(self) -> None:
        if self.profile.latency:
            await asyncio.sleep(self.profile.latency)

    # -- handlers ----------------------------------------------------------------------

    async def handle(self, request):
        """Dispatch; counts the requests in flight at once, data (GET, PUT) and metadata
        (the rest) apart: how much concurrency a client really gets from the store."""
        if request.path == STATS_PATH:
            return self.stats_response()
        kind = "data" if request.method in ("GET", "PUT") else "meta"
        self.in_flight[kind] += 1
        self.peak_in_flight[kind] = max(self.peak_in_flight[kind], self.in_flight[kind])
        try:
            return await self.dispatch(request)
        finally:
            self.in_flight[kind] -= 1

    async def dispatch(self, request):
        try:
            path = self.local(request.path)
        except PermissionError:
            return self.plain(403, "outside the store")
        method = request.method
        if method in ("GET", "HEAD") and os.path.isdir(path):
            await self.meta_wait()
            self.counts["list"] += 1
            return self.listing(request, path)
        if method == "GET":
            return await self.get(request, path)
        if method == "HEAD":
            return await self.head(path)
        if method == "PUT":
            return await self.put(request, path)
        if method == "DELETE":
            return await self.delete(request, path)
        if method == "POST":
            return await self.post(request, path)
        return self.plain(405, f"{method} not supported")

    def plain(self, status: int, text: str, headers: dict | None = None):
        if status == 404:
            self.counts["not_found"] += 1
        return web.Response(status=status, text=text, headers=headers)

    def stats_response(self):
        return web.json_response({"requests": dict(self.counts), "bytes_sent": self.bytes_sent,
                                  "bytes_received": self.bytes_received,
                                  "peak_in_flight": dict(self.peak_in_flight),
                                  "profile": dataclasses.asdict(self.profile)})

    def listing(self, request, path: str):
        names = sorted(os.listdir(path))
        if request.query.get("list") == "json":
            entries = []
            for name in names:
                try:
                    st = os.stat(os.path.join(path, name))
                except FileNotFoundError:
                    continue
                is_dir = os.path.isdir(os.path.join(path, name))
                entries.append({"name": name, "size": 0 if is_dir else st.st_size,
                                "type": "directory" if is_dir else "file",
                                "ETag": None if is_dir else etag_of(st)})
            return web.json_response(entries)
        links = []
        for name in names:
            slash = "/" if os.path.isdir(os.path.join(path, name)) else ""
            quoted = html.escape(name + slash, quote=True)
            links.append(f'<a href="{quoted}">{quoted}</a>')
        body = "<html><body>\n" + "\n".join(links) + "\n</body></html>\n"
        return web.Response(text=body, content_type="text/html")

    async def head(self, path: str):
        await self.meta_wait()
        self.counts["head"] += 1
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self.plain(404, "not found")
        return web.Response(status=200, headers={
            "Content-Length": str(st.st_size), "ETag": etag_of(st), "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream"})

    async def get(self, request, path: str):
        await self.data_wait()
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return self.plain(404, "not found")
        with f:
            st = os.fstat(f.fileno())
            etag = etag_of(st)
            wanted = request.headers.get("If-Match")
            if wanted is not None and wanted.strip() != "*" and \
                    etag not in [t.strip() for t in wanted.split(",")]:
                self.counts["precondition_failed"] += 1
                return self.plain(412, "precondition failed", {"ETag": etag})
            try:
                rng = parse_range(request.headers.get("Range"), st.st_size)
            except ValueError:
                return self.plain(416, "range not satisfiable",
                                  {"Content-Range": f"bytes */{st.st_size}"})
            start, end = rng if rng is not None else (0, st.st_size)
            self.counts["get_range" if rng is not None else "get"] += 1
            headers = {"ETag": etag, "Accept-Ranges": "bytes",
                       "Content-Length": str(end - start),
                       "Content-Type": "application/octet-stream"}
            if rng is not None:
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{st.st_size}"
            resp = web.StreamResponse(status=206 if rng is not None else 200, headers=headers)
            await resp.prepare(request)
            pos = start
            try:
                while pos < end:
                    piece = os.pread(f.fileno(), min(PIECE, end - pos), pos)
                    if not piece:  # the file shrank under us: fewer bytes than the headers
                        # said. Cut the connection, as nginx and Apache do, so the client
                        # sees a short body at once; ended as a whole reply, it waited for
                        # the rest until its own timeout (300 s: review loaders6)
                        self.counts["cut_short"] += 1
                        resp.force_close()
                        if request.transport is not None:
                            request.transport.close()
                        return resp
                    await self.link.take(len(piece))
                    await resp.write(piece)
                    pos += len(piece)
                    self.bytes_sent += len(piece)
                await resp.write_eof()
            except ConnectionResetError:  # the client stopped reading (fsspec's HTTP
                self.counts["aborted"] += 1  # exists() is a GET it closes after the headers)
            return resp

    async def put(self, request, path: str):
        await self.data_wait()
        self.counts["put"] += 1
        if os.path.isdir(path):
            return self.plain(409, "is a directory")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)  # object-store semantics: no mkdir needed
        tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.put")
        try:
            with open(tmp, "wb") as f:
                async for piece in request.content.iter_chunked(PIECE):
                    await self.link.take(len(piece))
                    f.write(piece)
                    self.bytes_received += len(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return self.plain(201, "created", {"ETag": etag_of(os.stat(path))})

    async def delete(self, request, path: str):
        await self.meta_wait()
        self.counts["delete"] += 1
        try:
            if os.path.isdir(path):
                if request.query.get("recursive") == "1":
                    for top, dirs, files in os.walk(path, topdown=False):
                        for name in files:
                            os.unlink(os.path.join(top, name))
                        for name in dirs:
                            os.rmdir(os.path.join(top, name))
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            return self.plain(404, "not found")
        except OSError as exc:
            return self.plain(409, str(exc))
        return self.plain(204, "")

    async def post(self, request, path: str):
        await self.meta_wait()
        op = request.query.get("op")
        if op == "mkdir":
            self.counts["mkdir"] += 1
            if os.path.exists(path) and request.query.get("exist_ok") != "1":
                return self.plain(409, "exists")
            os.makedirs(path, exist_ok=True)
            return self.plain(201, "created")
        if op == "mv":
            self.counts["mv"] += 1
            try:
                target = self.local(request.query.get("to", ""))
            except PermissionError:
                return self.plain(403, "outside the store")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.replace(path, target)
            except FileNotFoundError:
                return self.plain(404, "not found")
            except OSError as exc:
                return self.plain(409, str(exc))
            return self.plain(200, "moved")
        return self.plain(400, f"unknown op {op!r}")


# -- the process ----------------------------------------------------------------------

def serve(root: str, profile: StoreProfile, host: str, port: int, owned: bool = False) -> None:
    store = Store(root, profile)
    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", store.handle)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
        await site.start()
        bound = runner.addresses[0]
        print(f"listening on http://{bound[0]}:{bound[1]}", flush=True)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, done.set)
        # owned: Ctrl-C is the owner's to act on (it ends us by closing our stdin once its
        # readers are done); a store dying first made their reads fail as if files were gone
        loop.add_signal_handler(signal.SIGINT, (lambda: None) if owned else done.set)

        def stdin_readable() -> None:  # the parent closed our stdin, or died
            if not os.read(sys.stdin.fileno(), 4096):
                done.set()

        if owned:  # its owner's pipe (on its own, stdin may be /dev/null, which epoll refuses)
            loop.add_reader(sys.stdin.fileno(), stdin_readable)
        await done.wait()
        await runner.cleanup()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cachemw.job.store", description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="the directory the store serves")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--latency-ms", type=float, default=StoreProfile.latency * 1e3)
    p.add_argument("--meta-latency-ms", type=float, default=StoreProfile.meta_latency * 1e3)
    p.add_argument("--bandwidth", type=float, default=StoreProfile.bandwidth,
                   help="bytes per second shared by all requests (0: unlimited)")
    p.add_argument("--owned", action="store_true", help="started by a process that ends it by "
                   "closing its standard input (a pipe): Ctrl-C (SIGINT) is that process's, not "
                   "ours (without it: runs until SIGINT or SIGTERM)")
    args = p.parse_args(argv)
    profile = StoreProfile(latency=args.latency_ms / 1e3, bandwidth=args.bandwidth,
                           meta_latency=args.meta_latency_ms / 1e3)
    serve(args.root, profile, args.host, args.port, owned=args.owned)
    return 0


class EmulatedStore:
    """The store as a child process: ``with EmulatedStore(root, profile) as store:
    store.url``. Its standard input is a pipe it watches, so it ends with this process
    however this process ends."""

    def __init__(self, root: str, profile: StoreProfile, host: str = "127.0.0.1") -> None:
        self.root = root
        self.profile = profile
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> "EmulatedStore":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachemw.job.store", "--root", self.root, "--host", self.host,
             "--owned", *self.profile.arguments()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.close()
            raise RuntimeError(f"the emulated store did not start (it said {line!r}; "
                               f"is aiohttp installed?)")
        self.url = line.split()[-1]
        return self

    def stats(self) -> dict:
        """Request and byte counters since the store started."""
        with urllib.request.urlopen(self.url + STATS_PATH, timeout=10) as r:
            return json.load(r)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            proc.stdout.close()

    def __enter__(self) -> "EmulatedStore":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
