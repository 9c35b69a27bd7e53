"""fsspec's own conformance suite, run against cachemw over a local target."""
from __future__ import annotations

import pytest
import fsspec
import fsspec.tests.abstract as abstract


class CachemwFixtures(abstract.AbstractFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls):
        # autostart: a daemon process tied to this test process serves the whole class.
        return fsspec.filesystem("cachemw", target_protocol="file",
                                 target_options={"auto_mkdir": True}, skip_instance_cache=True)

    @pytest.fixture
    def fs_path(self, tmpdir):
        return str(tmpdir)

    @pytest.fixture
    def supports_empty_directories(self):
        return True


class TestCachemwCopy(abstract.AbstractCopyTests, CachemwFixtures):
    pass


class TestCachemwGet(abstract.AbstractGetTests, CachemwFixtures):
    pass


class TestCachemwPut(abstract.AbstractPutTests, CachemwFixtures):
    pass


class TestCachemwPipe(abstract.AbstractPipeTests, CachemwFixtures):
    pass


class TestCachemwOpen(abstract.AbstractOpenTests, CachemwFixtures):
    pass
