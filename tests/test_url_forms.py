"""The URL forms of the README, exactly as a user writes them, and the names the filesystem
hands back (glob, ls, info): each is accepted by a second call, reads the bytes of the
file it names, and reads them through the cache (never around it).

``cachemw:///abs`` is the absolute path /abs wherever the working directory is; so is
``cachemw://abs``, which is what HF datasets makes of the first.
"""
from __future__ import annotations

import fsspec
import pytest

from cachemw.client.fs import CacheFileSystem
from cachemw.launch import stop_local
from conftest import daemon_stats


@pytest.fixture
def autostarted(runtime_dir):
    """Filesystems built by fsspec from URLs autostart this test's private daemon."""
    CacheFileSystem.clear_instance_cache()  # earlier tests' instances serve their own dirs
    yield runtime_dir
    CacheFileSystem.clear_instance_cache()
    stop_local(runtime_dir)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """Three files under tmp_path/src, and a decoy copy with other bytes where the same
    absolute path, read as relative, would land from the working directory (tmp_path)."""
    root = tmp_path / "src"
    root.mkdir()
    files = {}
    for i in range(3):
        p = root / f"f{i}.bin"
        p.write_bytes(f"file {i} ".encode() * (1000 + i))
        files[str(p)] = p.read_bytes()
    (root / "other.txt").write_bytes(b"not matched")
    decoy = tmp_path / str(root).lstrip("/")
    decoy.mkdir(parents=True)
    for i in range(3):
        (decoy / f"f{i}.bin").write_bytes(b"DECOY")
    monkeypatch.chdir(tmp_path)
    return str(root), files


def _leases(runtime_dir):
    return daemon_stats(runtime_dir)["counters"]["leases"]


@pytest.mark.timeout(60)
def test_url_paths_are_absolute_wherever_the_working_directory_is(autostarted, tree):
    root, files = tree
    path = f"{root}/f0.bin"
    for url in (f"cachemw://{path}",             # cachemw:///abs: the README's shorthand
                f"cachemw://{path.lstrip('/')}",  # cachemw://abs: HF datasets' rewrite of it
                f"cachemw::file://{path}"):
        with fsspec.open(url, "rb") as f:
            assert isinstance(f.fs, CacheFileSystem), url
            assert f.read() == files[path], url
        fs, p = fsspec.core.url_to_fs(url)
        assert fs.info(p)["name"] == path, url
    assert _leases(autostarted) == 1  # one fill, then hits: all three read through the cache


@pytest.mark.timeout(60)
def test_glob_ls_info_names_are_accepted_back(autostarted, tree):
    """glob answers with URLs that any call takes back, alone or with the hops HF datasets
    re-appends (``<name>::file://<pattern>``); ls and info with the target's paths."""
    root, files = tree
    fs = fsspec.filesystem("cachemw", target_protocol="file")
    for pattern in (f"{root}/*.bin", f"cachemw://{root}/*.bin", f"cachemw::file://{root}/*.bin"):
        names = fs.glob(pattern)
        assert names == [f"cachemw://{p}" for p in sorted(files)], pattern
        assert list(fs.glob(pattern, detail=True)) == names
        for name, path in zip(names, sorted(files)):
            assert fs.url(path) == fs.url(name) == name
            assert fs.cat_file(name) == files[path]
            assert fs.info(name)["name"] == path
            assert fs.unstrip_protocol(name) == f"cachemw::file://{path}"
            with fsspec.open(f"{name}::file://{pattern}", "rb") as f:
                assert isinstance(f.fs, CacheFileSystem)
                assert f.read() == files[path]
    assert sorted(fs.ls(root, detail=False)) == sorted([*files, f"{root}/other.txt"])
    for name in fs.ls(f"cachemw://{root}", detail=False):
        assert fs.info(name)["name"] == name
        assert fs.cat_file(name) == (files.get(name) or b"not matched")
    # fsspec's own glob users get paths back as before: cat, expand_path
    assert fs.cat(f"{root}/*.bin") == files
    assert fs.expand_path(f"cachemw://{root}/*.bin") == sorted(files)
    assert _leases(autostarted) == 4


@pytest.mark.timeout(60)
def test_s3_forms(autostarted, s3_server):
    """The README's S3 forms, the names the filesystem hands back, and the options as HF
    datasets passes them (flat storage_options reach every hop)."""
    s3 = s3_server["target_options"]
    bucket = s3_server["bucket"]
    client = s3_server["boto3"]()
    files = {}
    for i in range(3):
        key = f"forms/f{i}.bin"
        files[f"{bucket}/{key}"] = data = f"object {i} ".encode() * (500 + i)
        client.put_object(Bucket=bucket, Key=key, Body=data)
    first = f"{bucket}/forms/f0.bin"

    with fsspec.open(f"cachemw::s3://{first}", "rb", s3=s3) as f:
        assert isinstance(f.fs, CacheFileSystem)
        assert f.read() == files[first]
    fs = fsspec.filesystem("cachemw", target_protocol="s3", target_options=s3)
    pattern = f"{bucket}/forms/*.bin"
    names = fs.glob(pattern)
    assert names == [f"cachemw://{p}" for p in sorted(files)]
    for name, path in zip(names, sorted(files)):
        assert fs.url(path) == name
        assert fs.cat_file(name) == files[path]
        assert fs.info(name)["name"] == path
        assert fs.unstrip_protocol(name) == f"cachemw::s3://{path}"
        # as HF datasets re-opens it: per-protocol options, then flat ones copied to each hop
        for options in ({"s3": s3}, {"cachemw": dict(s3), "s3": s3}):
            with fsspec.open(f"{name}::s3://{pattern}", "rb", **options) as f:
                assert isinstance(f.fs, CacheFileSystem)
                assert f.read() == files[path]
    for name in fs.ls(f"{bucket}/forms", detail=False):
        assert fs.cat_file(name) == files[name]
        assert fs.info(name)["name"] == name
    assert _leases(autostarted) == 3

    # a URL of another store is an error, not a read of some other object
    with pytest.raises(ValueError, match="file://"):
        fs.cat_file(f"cachemw::file:///{first}")
    for url in (f"gcs://{first}", f"file:///{first}"):  # bare, as every method takes URLs
        with pytest.raises(ValueError, match=url.partition(":")[0]):
            fs.cat_file(url)
    assert fs.cat_file(f"s3://{first}") == files[first]  # the target's own: its path
    # a misspelt option is still an error when the target's options ride along
    with pytest.raises(ValueError, match="valdate"):
        fsspec.open(f"cachemw::s3://{first}", "rb", cachemw={"valdate": "immutable", **s3},
                    s3=s3).open()


@pytest.mark.timeout(60)
def test_chained_urls_share_one_filesystem(autostarted, tree):
    """fsspec hands each chained URL's path to the filesystem (``fo``): one filesystem (and
    one daemon connection) per URL opened, unless the path is left out of its identity."""
    root, files = tree
    seen = set()
    for path in sorted(files):
        for url in (f"cachemw::file://{path}", f"cachemw://{path}::file://{root}/*.bin"):
            with fsspec.open(url, "rb") as f:
                assert f.read() == files[path]
                seen.add(id(f.fs))
    assert len(seen) == 1


@pytest.mark.timeout(60)
def test_relative_paths_follow_the_working_directory(autostarted, tmp_path, monkeypatch):
    """A relative local path or ``file://`` URL is relative to the working directory of the
    call, not of an earlier call (no remembered resolution reads another file)."""
    for d in ("a", "b"):
        (tmp_path / d / "rel").mkdir(parents=True)
        (tmp_path / d / "rel" / "x.bin").write_bytes(d.encode() * 100)
    fs = fsspec.filesystem("cachemw", target_protocol="file")
    for d in ("a", "b", "a"):
        monkeypatch.chdir(tmp_path / d)
        for path in ("rel/x.bin", "file://rel/x.bin", "cachemw::file://rel/x.bin"):
            assert fs.cat_file(path) == d.encode() * 100, (d, path)
    # URLs of this filesystem are absolute: the same file from anywhere
    monkeypatch.chdir(tmp_path / "b")
    assert fs.cat_file(f"cachemw://{tmp_path}/a/rel/x.bin") == b"a" * 100


@pytest.mark.timeout(60)
def test_cli_warm_takes_a_relative_directory(autostarted, tmp_path, monkeypatch, capsys):
    """``cachemw warm data/train`` warms ./data/train (a cachemw:// URL is absolute, so the
    command makes the path absolute before it becomes one)."""
    from cachemw.cli import main

    (tmp_path / "data" / "train").mkdir(parents=True)
    for i in range(2):
        (tmp_path / "data" / "train" / f"{i}.bin").write_bytes(b"x" * 2048)
    monkeypatch.chdir(tmp_path)
    assert main(["warm", "--quiet", "data/train"]) == 0
    assert "warmed 4.0 KiB" in capsys.readouterr().out
    assert _leases(autostarted) == 2


def test_local_paths_resolve_as_fsspec_resolves_them(tmp_path, monkeypatch):
    """The shortcut for absolute local paths (urls.plain_local: no fsspec call per path)
    gives fsspec's own answer, for the local filesystem and a subclass of it with its own
    protocol; a subclass that parses paths itself gets its own parsing."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from cachemw.client.urls import TargetPaths, plain_local, target_url

    class Other(LocalFileSystem):
        protocol = "otherfile"

    class Parses(LocalFileSystem):
        protocol = "parsesfile"

        @classmethod
        def _strip_protocol(cls, path):
            return "/parsed" + LocalFileSystem._strip_protocol(path)

    monkeypatch.chdir(tmp_path)
    paths = ["/d/f", "/d/f/", "/", "/d//f", "/d/./f", "/d/../f", "rel/f", "./f", "~/f",
             "file:///d/f", "local:///d/f", "/d/\u00fc ber", "/d/a:b"]
    for fs, plain in ((LocalFileSystem(), True), (Other(), True), (Parses(), False)):
        assert plain_local(fs) is plain
        url = target_url(fs)
        for path in paths:
            if not path.startswith(("file:", "local:")):
                assert url(path) == fs.unstrip_protocol(path), (fs, path)
    fsspec.register_implementation("otherfile", Other, clobber=True)
    fsspec.register_implementation("parsesfile", Parses, clobber=True)
    for protocol in ("file", "otherfile", "parsesfile"):
        cfs = fsspec.filesystem("cachemw", target_protocol=protocol,
                                runtime_dir=str(tmp_path / "rt"), skip_instance_cache=True)
        for path in paths:  # the filesystem's paths, and the URLs its metadata and blocks
            stripped = cfs._strip_protocol(path)  # are keyed by (the key a write drops)
            assert stripped == TargetPaths(cfs.target)(path), (protocol, path)
            assert cfs.meta._url(stripped) == cfs.target.unstrip_protocol(stripped), (protocol, path)
