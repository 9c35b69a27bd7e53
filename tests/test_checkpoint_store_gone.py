"""The Checkpointer on an S3 root whose endpoint stops answering: every failure it meets
there is an OSError (as the cache's own reads raise it), not botocore's
EndpointConnectionError, which is no OSError, so ``except OSError`` around a save, a wait
or a load catches a store's outage. The checkpoint before the outage stays whole."""
from __future__ import annotations

import logging
import socket

import pytest
import torch

from cachemw.checkpoint import Checkpointer

pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def own_s3(monkeypatch):
    """A moto S3 server of this test's own (it is stopped mid-test), reached through the
    standard AWS variables; client retries cut to one so a dead endpoint fails fast."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for var, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}.items():
        monkeypatch.setenv(var, value)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="ckpts")
    s3fs.S3FileSystem.clear_instance_cache()
    stopped = []
    try:
        yield lambda: stopped.append(server.stop())
    finally:
        if not stopped:
            server.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def _retries_cut(monkeypatch):
    """s3fs asks again up to 5 times with backoff on a connection error; once is enough here."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)


@pytest.mark.timeout(120)
def test_a_save_to_a_store_gone_fails_with_an_oserror(own_s3, monkeypatch):
    _retries_cut(monkeypatch)
    state = {"w": torch.arange(1000.0)}
    with Checkpointer("s3://ckpts/run", fast_root=None) as ck:
        ck.save(1, state).wait(60)
        own_s3()  # the endpoint stops answering
        handle = ck.save(2, state)
        with pytest.raises(OSError) as raised:
            handle.wait(60)  # before: botocore's EndpointConnectionError (no OSError)
        assert "s3://ckpts/run" in str(raised.value) or "ckpts/run" in str(raised.value)
        assert "botocore" in type(raised.value.__cause__).__module__
        with pytest.raises(OSError):
            ck.wait()
        with pytest.raises(OSError):  # asking the root for its steps
            ck.steps()
        with pytest.raises(OSError):
            ck.load({"w": torch.zeros(1000)})


@pytest.mark.timeout(120)
def test_a_checkpointer_made_on_a_store_gone_fails_with_an_oserror(own_s3, monkeypatch):
    _retries_cut(monkeypatch)
    own_s3()
    with pytest.raises(OSError) as raised:
        Checkpointer("s3://ckpts/run", fast_root=None)
    assert "botocore" in type(raised.value.__cause__).__module__
