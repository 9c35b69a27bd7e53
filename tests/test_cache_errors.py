"""Errors: a missing file is FileNotFoundError naming the path (and is not remembered as
missing); target errors are OSError subclasses; a bad option is ValueError naming it."""
from __future__ import annotations

import fsspec
import pytest

BS = 65536


@pytest.mark.parametrize("validate", ["immutable", "ttl", "always"])
def test_missing_file_names_the_path(make_cache_fs, tmp_path, validate):
    fs = make_cache_fs(validate=validate, block_size=BS)
    missing = str(tmp_path / "nope" / "missing.bin")
    for call in (lambda: fs.cat_file(missing), lambda: fs.cat_file(missing, 5, 10),
                 lambda: fs.open(missing, "rb"), lambda: fs.info(missing),
                 lambda: fs.ls(missing),
                 lambda: fs.cat_ranges([missing], [0], [1], on_error="raise")):
        with pytest.raises(FileNotFoundError) as exc:
            call()
        assert missing in str(exc.value)
    assert not fs.exists(missing)
    # a file that appears later is seen, even under "immutable" (no negative caching)
    (tmp_path / "nope").mkdir()
    with open(missing, "wb") as f:
        f.write(b"now here")
    assert fs.cat_file(missing) == b"now here"
    assert fs.exists(missing)


def test_missing_file_through_a_url(make_cache_fs, tmp_path):
    make_cache_fs()  # the private daemon
    missing = str(tmp_path / "missing.bin")
    for url in (f"cachemw::file://{missing}", f"cachemw://{missing}"):
        with pytest.raises(FileNotFoundError) as exc:
            with fsspec.open(url, "rb", cachemw={"autostart": False}) as f:
                f.read()
        assert missing in str(exc.value)


def test_target_errors_are_oserrors(make_cache_fs, tmp_path):
    fs = make_cache_fs()
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(IsADirectoryError):
        fs.cat_file(str(tmp_path / "d"))
    with pytest.raises(OSError):
        fs.cat_file(str(tmp_path / "f" / "below-a-file"))
    with pytest.raises(OSError):
        fs.pipe_file(str(tmp_path / "f" / "below-a-file"), b"x")


BAD_OPTIONS = [
    ("validate", "bogus"), ("validate", ""), ("ttl", -1), ("ttl", "abc"), ("block_size", "abc"),
    ("block_size", -5), ("block_size", 100), ("block_size", True), ("autostart", "yes"),
    ("daemon_options", "notadict"),
]


@pytest.mark.parametrize("name,value", BAD_OPTIONS)
def test_bad_option_is_a_value_error_naming_it(name, value, tmp_path):
    with pytest.raises(ValueError, match=name):
        fsspec.filesystem("cachemw", target_protocol="file", skip_instance_cache=True,
                          **{name: value})
    with pytest.raises(ValueError, match=name):
        fsspec.open(f"cachemw::file://{tmp_path}/x", "rb", cachemw={name: value}).open()


@pytest.mark.parametrize("name,value", [("target_options", "notadict"), ("fs", "notafs")])
def test_a_target_of_the_wrong_type_is_a_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        fsspec.filesystem("cachemw", skip_instance_cache=True, **{name: value})


def test_unknown_option_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="valdate"):
        fsspec.filesystem("cachemw", target_protocol="file", skip_instance_cache=True,
                          valdate="always")
    with pytest.raises(ValueError, match="client_kwargs"):  # the target's: target_options
        fsspec.filesystem("cachemw", target_protocol="file", skip_instance_cache=True,
                          client_kwargs={"endpoint_url": "http://127.0.0.1:9"})
    with pytest.raises(ValueError, match="block_size"):  # (False is no 0)
        fsspec.filesystem("cachemw", target_protocol="file", skip_instance_cache=True,
                          block_size=False)
    for protocol, key in (("file", "file"), ("local", "file"), (None, "local")):
        # the target's own protocol, under any of its names (diffrev-9), other options
        with pytest.raises(ValueError, match=f"unknown cachemw option.*: {key}"):
            fsspec.filesystem("cachemw", target_protocol=protocol, skip_instance_cache=True,
                              **{key: {"auto_mkdir": True}})


def test_another_filesystems_options_are_left_to_it(tmp_path):
    """One ``storage_options`` for ``cachemw::s3://`` and ``cachemw:///`` URLs alike: fsspec
    hands the options of a protocol the chain has no hop for to its first hop, and
    simplecache ignores them; cachemw refused them (review api7)."""
    path = tmp_path / "f.txt"
    path.write_bytes(b"x" * 29)
    options = {"s3": {"anon": True}, "cachemw": {"runtime_dir": str(tmp_path / "rt"),
                                                 "autostart": False}}
    for url in (f"cachemw::file://{path}", f"cachemw://{path}"):
        with fsspec.open(url, "rb", **options) as f:
            assert f.read() == b"x" * 29


def test_what_callers_hand_every_filesystem_is_taken_as_fsspec_takes_it(tmp_path):
    """HF datasets' streaming opens hand the filesystem a file's open arguments
    (``encoding``, ``errors``), a tar archive's ``block_size=0`` (fsspec's "no
    read-ahead") and a compression hop's aiohttp ``client_kwargs``: every fsspec
    filesystem takes them, cachemw refused them (found by a black-box check). An HTTP
    target's client gets the ``client_kwargs`` (under its own options, which win)."""
    (tmp_path / "lines.txt").write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    fs = fsspec.filesystem("cachemw", target_protocol="file", skip_instance_cache=True,
                           encoding="utf-8", errors="strict", newline=None, block_size=0,
                           client_kwargs={"trust_env": True, "requote_redirect_url": False},
                           runtime_dir=str(tmp_path / "rt"), autostart=False)
    assert fs.options.block_size == 8 << 20  # the default unit
    with fs.open(str(tmp_path / "lines.txt"), block_size=0) as f:  # readline read nothing
        assert f.readline() == b"line 0\n" and len(list(f)) == 999
    http = fsspec.filesystem("cachemw", target_protocol="http", skip_instance_cache=True,
                             target_options={"client_kwargs": {"trust_env": False}},
                             client_kwargs={"trust_env": True, "requote_redirect_url": False},
                             runtime_dir=str(tmp_path / "rt"), autostart=False)
    assert http.target.client_kwargs == {"trust_env": False, "requote_redirect_url": False}


@pytest.mark.parametrize("name,value", [("CACHEMW_VALIDATE", "bogus"), ("CACHEMW_TTL", "soon"),
                                        ("CACHEMW_BLOCK_SIZE", "huge"),
                                        ("CACHEMW_AUTOSTART", "maybe"),
                                        ("CACHEMW_GC_FREEZE", "maybe"),
                                        ("CACHEMW_WORKER_HEAP", "maybe")])
def test_bad_environment_option_is_a_value_error(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    option = name[len("CACHEMW_"):].lower()
    with pytest.raises(ValueError, match=f"{name}|{option}"):
        fsspec.filesystem("cachemw", target_protocol="file", skip_instance_cache=True)


ENV_OPTIONS = ("CACHEMW_VALIDATE", "CACHEMW_TTL", "CACHEMW_BLOCK_SIZE", "CACHEMW_AUTOSTART",
               "CACHEMW_RUNTIME_DIR", "CACHEMW_WRITE_BEHIND", "CACHEMW_DAEMON_TIMEOUT",
               "CACHEMW_DRAM_DIR", "CACHEMW_DRAM_CAPACITY", "CACHEMW_NVME_DIR",
               "CACHEMW_NVME_CAPACITY", "CACHEMW_PLACEMENT", "CACHEMW_GC_FREEZE",
               "CACHEMW_WORKER_HEAP", "CACHEMW_METRICS_PORT", "CACHEMW_METRICS_HOST",
               "CACHEMW_TRACE", "CACHEMW_LOG_LEVEL")


def test_every_empty_environment_variable_counts_as_unset(monkeypatch, tmp_path):
    """README: an empty variable counts as unset (a job script's `export X=` of nothing)."""
    for name in ENV_OPTIONS:
        monkeypatch.setenv(name, "")
    from cachemw.config import DaemonConfig
    fs = fsspec.filesystem("cachemw", target_protocol="file", autostart=True,
                           runtime_dir=str(tmp_path / "rt"), skip_instance_cache=True)
    assert fs.options.validate == "ttl" and fs.options.block_size == 8 << 20
    assert fs.options.write_behind == 32 << 20
    assert DaemonConfig.build(runtime_dir=str(tmp_path / "rt")).log_level == "INFO"


@pytest.mark.parametrize("options,name", [
    ({"dram_capacity": "lots"}, "dram_capacity"),
    ({"bogus": 1}, "bogus"),
    ({"dram_dir": "relative/dram"}, "dram_dir"),
    ({"nvme_dir": "relative/nvme", "nvme_capacity": "1GiB"}, "nvme_dir"),
])
def test_bad_daemon_option_is_a_value_error(runtime_dir, tmp_path, options, name):
    (tmp_path / "f").write_bytes(b"data")
    with pytest.raises(ValueError, match=name):
        fs = fsspec.filesystem("cachemw", target_protocol="file", skip_instance_cache=True,
                               runtime_dir=runtime_dir, daemon_options=options)
        fs.cat_file(str(tmp_path / "f"))
