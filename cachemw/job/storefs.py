"""``jobstore://HOST:PORT/path``: an fsspec filesystem that reads and writes the emulated
store (store.py), for the job's checkpoints.

Why a filesystem of its own: fsspec's HTTP filesystem reads only, and every checkpoint
method the job compares writes to the store the way it writes to a PFS (``torch.save``
into a file, DCP's fsspec writer, the Checkpointer's root), so their bytes cross the same
shared link as the training data does. Writes stream: ``open(path, "wb")`` sends a chunked
``PUT`` as the caller writes, so a writer is held back by the store's bandwidth while it
writes, as on a PFS, and ``close`` returns once the server has written, fsynced and
renamed the file (durable).

Plain ``http.client`` connections, one per thread (DCP writes from several threads).
"""
from __future__ import annotations

import errno
import http.client
import io
import json
import threading
import urllib.parse

import fsspec
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

PROTOCOL = "jobstore"


def _raise_for(status: int, path: str, text: str = "") -> None:
    if status < 300:
        return
    if status == 404:
        raise FileNotFoundError(errno.ENOENT, f"{path}: not found in the store", path)
    if status == 409:
        raise FileExistsError(errno.EEXIST, f"{path}: {text or 'conflict'}", path)
    if status == 412:
        raise OSError(errno.ESTALE, f"{path}: the store has another version of it")
    raise OSError(errno.EIO, f"{path}: HTTP {status} from the store: {text[:200]}")


class StoreFileSystem(AbstractFileSystem):
    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, timeout: float = 300.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.timeout = timeout
        self._local = threading.local()

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = fsspec.utils.stringify_path(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:]
        return path.rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    # -- the wire ----------------------------------------------------------------------

    @staticmethod
    def _split(path: str) -> tuple[str, str]:
        host, _, rest = path.partition("/")
        if not host:
            raise ValueError(f"{PROTOCOL}: expected {PROTOCOL}://HOST:PORT/path, got {path!r}")
        return host, "/" + urllib.parse.quote(rest)

    def _connection(self, host: str) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(host)
        if conn is None:
            conn = conns[host] = http.client.HTTPConnection(host, timeout=self.timeout)
        return conn

    def _request(self, method: str, path: str, query: dict | None = None, body=None,
                 headers: dict | None = None) -> tuple[int, dict, bytes]:
        host, url = self._split(self._strip_protocol(path))
        if query:
            url += "?" + urllib.parse.urlencode(query)
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more
            conn = self._connection(host)
            try:
                conn.request(method, url, body=body, headers=headers or {})
                resp = conn.getresponse()
                return resp.status, dict(resp.getheaders()), resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if attempt or body is not None and not isinstance(body, bytes):
                    raise
        raise AssertionError("unreachable")

    # -- metadata ----------------------------------------------------------------------

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        status, _, data = self._request("GET", path + "/", {"list": "json"})
        if status == 200 and data.startswith(b"["):
            entries = [{**e, "name": f"{path}/{e['name']}"} for e in json.loads(data)]
            return entries if detail else [e["name"] for e in entries]
        if status == 404:
            raise FileNotFoundError(errno.ENOENT, f"{path}: not found in the store", path)
        info = self.info(path)  # a file lists as itself
        return [info] if detail else [info["name"]]

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        status, headers, _ = self._request("HEAD", path)
        if status == 200 and "ETag" in headers:
            return {"name": path, "size": int(headers["Content-Length"]), "type": "file",
                    "ETag": headers["ETag"]}
        if status == 200:  # a directory (listed, no ETag)
            return {"name": path, "size": 0, "type": "directory"}
        _raise_for(status, path)
        raise OSError(errno.EIO, f"{path}: HTTP {status}")

    def makedirs(self, path, exist_ok=False):
        path = self._strip_protocol(path)
        status, _, text = self._request("POST", path, {"op": "mkdir", "exist_ok": int(exist_ok)})
        _raise_for(status, path, text.decode(errors="replace"))

    def mkdir(self, path, create_parents=True, **kwargs):
        self.makedirs(path, exist_ok=False)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        host1, _ = self._split(path1)
        host2, url2 = self._split(path2)
        if host1 != host2:
            raise ValueError(f"{PROTOCOL}: cannot move {path1} to another store ({path2})")
        status, _, text = self._request("POST", path1, {"op": "mv", "to": urllib.parse.unquote(url2)})
        _raise_for(status, path1, text.decode(errors="replace"))

    def rename(self, path1, path2, **kwargs):
        self.mv(path1, path2)

    def rm_file(self, path):
        path = self._strip_protocol(path)
        status, _, text = self._request("DELETE", path)
        _raise_for(status, path, text.decode(errors="replace"))

    def rm(self, path, recursive=False, maxdepth=None):
        for p in path if isinstance(path, list) else [path]:
            p = self._strip_protocol(p)
            status, _, text = self._request("DELETE", p, {"recursive": int(bool(recursive))})
            _raise_for(status, p, text.decode(errors="replace"))

    def rmdir(self, path):
        self.rm_file(path)

    # -- data --------------------------------------------------------------------------

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        headers = {}
        if start is not None or end is not None:
            size = None
            if (start or 0) < 0 or (end is not None and end < 0):
                size = self.info(path)["size"]
            s = (start or 0) if (start or 0) >= 0 else size + start
            e = end if end is None or end >= 0 else size + end
            if e is not None and e <= s:
                return b""
            headers["Range"] = f"bytes={s}-" + ("" if e is None else str(e - 1))
        status, _, data = self._request("GET", path, headers=headers)
        if status == 416:
            return b""
        _raise_for(status, path, data[:200].decode(errors="replace"))
        return data

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        path = self._strip_protocol(path)
        status, _, text = self._request("PUT", path, body=bytes(value))
        _raise_for(status, path, text.decode(errors="replace"))

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        return StoreFile(self, self._strip_protocol(path), mode, block_size=block_size or 4 << 20,
                         cache_type="none" if "r" in mode else "readahead",
                         cache_options=cache_options)


class StoreFile(AbstractBufferedFile):
    """Reads by ranges; writes as one chunked PUT streamed while the caller writes.

    A write of a block or more goes to the connection as it is, and a buffered block is
    sent from the buffer's memory: no copy of the bytes on the way (a copy into fresh
    memory holds the GIL for the whole copy, page faults included: a checkpoint drained in
    a trainer's thread made its other threads wait 10-20 ms at a time)."""

    def _fetch_range(self, start, end):
        return self.fs.cat_file(self.path, start=start, end=end)

    def _initiate_upload(self):
        host, url = self.fs._split(self.path)
        self._conn = http.client.HTTPConnection(host, timeout=self.fs.timeout)
        self._conn.putrequest("PUT", url)
        self._conn.putheader("Transfer-Encoding", "chunked")
        self._conn.putheader("Content-Type", "application/octet-stream")
        self._conn.endheaders()

    def write(self, data):
        with memoryview(data) as whole, whole.cast("B") as view:
            if self.mode != "wb" or self.closed or self.forced or view.nbytes < self.blocksize:
                return super().write(data)  # small: buffered (the checks are there)
            if self.offset is None:
                self.offset = 0
                try:
                    self._initiate_upload()
                except Exception:
                    self.closed = True
                    raise
            if self.buffer.tell():  # small writes before it (torch.save's record headers)
                self._upload_chunk()
                self.offset += self.buffer.tell()
                self.buffer = io.BytesIO()
            self._send_chunk(view)
            self.loc += view.nbytes
            self.offset += view.nbytes
            return view.nbytes

    def _send_chunk(self, view: memoryview) -> None:
        if view.nbytes:
            self._conn.send(b"%x\r\n" % view.nbytes)
            self._conn.send(view)
            self._conn.send(b"\r\n")

    def _upload_chunk(self, final=False):
        with self.buffer.getbuffer() as view:
            self._send_chunk(view)
        if final:
            self._conn.send(b"0\r\n\r\n")
            resp = self._conn.getresponse()
            text = resp.read()
            self._conn.close()
            _raise_for(resp.status, self.path, text.decode(errors="replace"))
        return True


fsspec.register_implementation(PROTOCOL, StoreFileSystem, clobber=True)
