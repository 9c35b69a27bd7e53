"""Existing loaders read through cachemw by changing the filesystem or URL: pyarrow."""
from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.dataset as ds  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


@pytest.mark.timeout(120)
def test_pyarrow_dataset_through_cachemw(make_cache_fs, tmp_path):
    root = tmp_path / "pq"
    root.mkdir()
    tables = []
    for i in range(3):
        t = pa.table({"x": np.arange(i * 1000, (i + 1) * 1000), "y": np.random.rand(1000)})
        pq.write_table(t, str(root / f"part-{i}.parquet"))
        tables.append(t)
    want = pa.concat_tables(tables).sort_by("x")
    fs = make_cache_fs(validate="immutable")
    got = ds.dataset(str(root), filesystem=fs, format="parquet").to_table().sort_by("x")
    assert got.equals(want)
    first = fs.stats()
    assert first["misses"] == 3 and first["fallbacks"] == 0
    again = ds.dataset(str(root), filesystem=fs, format="parquet").to_table().sort_by("x")
    assert again.equals(want)
    second = fs.stats()
    assert second["misses"] == 3 and second["hits"] > first["hits"]  # all from the cache
    assert second["bytes_from_source"] == first["bytes_from_source"]
    # a single file by URL-less path, with pyarrow's own reader
    assert pq.read_table(str(root / "part-1.parquet"), filesystem=fs).equals(tables[1])


@pytest.mark.timeout(120)
def test_open_file_reads_are_counted_once(make_cache_fs, tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.bytes(200_000)
    path.write_bytes(data)
    fs = make_cache_fs(block_size=65536)
    fs.cat_file(str(path))  # cache every block
    before = fs.stats()["hits"]
    with fs.open(str(path)) as f:
        for off in (0, 70_000, 150_000, 10):
            f.seek(off)
            assert f.read(100) == data[off:off + 100]
    assert fs.stats()["hits"] - before == 4
