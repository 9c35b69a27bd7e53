"""Target options that have no JSON form (an aiobotocore session, an aiohttp
``ClientTimeout``) are what users pass to s3fs and fsspec's HTTP filesystem: reads,
announced orders and writes work with them, as with plain s3fs; only the daemon's own
fetches (prefetch, other nodes' owner fetches), which need the target described to
another process, are left to the reading process."""
from __future__ import annotations

import pytest

from conftest import daemon_stats


@pytest.mark.timeout(90)
def test_a_target_option_with_no_json_form(make_cache_fs, s3_server, runtime_dir):
    aiobotocore_session = pytest.importorskip("aiobotocore.session")
    options = {**s3_server["target_options"], "session": aiobotocore_session.AioSession()}
    bucket = s3_server["bucket"]
    paths = [f"{bucket}/nojson/f{i}" for i in range(4)]
    for i, p in enumerate(paths):
        s3_server["boto3"]().put_object(Bucket=bucket, Key=p.split("/", 1)[1],
                                        Body=bytes([i]) * 30_000)
    fs = make_cache_fs(target_protocol="s3", target_options=options)
    fs.announce(paths)  # kept for placement; the reads below fetch the blocks themselves
    for i, p in enumerate(paths):
        assert fs.cat_file(p) == bytes([i]) * 30_000
        assert fs.cat_file(p, 10, 20) == bytes([i]) * 10
    assert fs.stats()["hits"] >= 4
    fs.pipe_file(paths[0], b"new")
    assert fs.cat_file(paths[0]) == b"new"
    fs.client.flush()
    assert daemon_stats(runtime_dir)["counters"].get("prefetched", 0) == 0
