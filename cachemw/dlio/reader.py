"""DLIO's reader plug-in: the workload's files read through ``cachemw::``.

DLIO lists the dataset with ``os.listdir`` and hands each reader absolute POSIX paths; its
own readers then open them with ``np.load``, ``h5py.File`` and PIL, past any cache. This
reader reads the same paths through the node's cache (``cachemw:///abs/path``), decodes
them as DLIO's reader for the format does, and otherwise behaves like one (same samples,
same batches, same ``read_index``/``next``), so DLIO's figures compare the two as they are.

Whole-file formats (npz, npy, jpeg, png) are one ``cat_file`` each; HDF5 is opened as a file
object, so ``h5py`` fetches only the blocks a sample touches. The filesystem takes its
options from the ``CACHEMW_*`` variables (README "Options"), since DLIO hands a reader no
options of its own. It is made where the reader is (in each DataLoader worker, after the
fork), and starts the node's daemon if none runs.
"""
from __future__ import annotations

import io

import fsspec
import h5py
import numpy as np
from dlio_benchmark.common.constants import MODULE_DATA_READER
from dlio_benchmark.common.enumerations import FormatType
from dlio_benchmark.reader.reader_handler import FormatReader
from dlio_benchmark.utils.utility import Profile
from PIL import Image

dlp = Profile(MODULE_DATA_READER)


def _npz(data: bytes):
    # DLIO's generator writes plain arrays (x, y); no pickles, so none are loaded
    return np.load(io.BytesIO(data), allow_pickle=False)["x"]


def _npy(data: bytes):
    return np.load(io.BytesIO(data), allow_pickle=False)


def _image(data: bytes):
    return np.asarray(Image.open(io.BytesIO(data)))


WHOLE_FILE = {FormatType.NPZ: _npz, FormatType.NPY: _npy, FormatType.JPEG: _image,
              FormatType.PNG: _image}
SUPPORTED = sorted([f.value for f in WHOLE_FILE] + [FormatType.HDF5.value])


class CachemwReader(FormatReader):
    """A DLIO ``FormatReader`` for npz, npy, hdf5, jpeg and png files, reading through cachemw."""

    @dlp.log_init
    def __init__(self, dataset_type, thread_index, epoch):
        super().__init__(dataset_type, thread_index)
        self.format = FormatType(self._args.format)
        if self.format not in WHOLE_FILE and self.format is not FormatType.HDF5:
            raise ValueError(f"cachemw.dlio.reader.CachemwReader reads {', '.join(SUPPORTED)} files, "
                             f"not dataset.format {self.format.value!r}: remove reader.reader_classname "
                             f"from the workload to use DLIO's own reader for it")
        self.fs = fsspec.filesystem("cachemw", target_protocol="file")
        self.handles = {}  # HDF5: the cachemw file object under each open h5py.File

    @dlp.log
    def open(self, filename):
        super().open(filename)
        decode = WHOLE_FILE.get(self.format)
        if decode is not None:
            return decode(self.fs.cat_file(filename))
        handle = self.fs.open(filename, "rb")
        try:
            opened = h5py.File(handle, "r")
        except BaseException:
            handle.close()
            raise
        self.handles[filename] = handle
        return opened

    @dlp.log
    def close(self, filename):
        super().close(filename)
        opened = self.open_file_map.get(filename)
        if self.format is FormatType.HDF5 and opened is not None:
            opened.close()
        handle = self.handles.pop(filename, None)
        if handle is not None:
            handle.close()
        # DLIO's DataLoader workers are persistent and end by SIGTERM when DLIO exits, so the
        # client's report at process exit never runs there: report each file's counts (hits,
        # misses) to the daemon as it is closed, one one-way message, or `cachemw stats`
        # would miss the last half second of reads of every worker
        self.fs.client.flush()

    @dlp.log
    def get_sample(self, filename, sample_index):
        super().get_sample(filename, sample_index)
        opened = self.open_file_map[filename]
        if self.format is FormatType.HDF5:
            image = opened["records"][sample_index]
        elif self.format in (FormatType.NPZ, FormatType.NPY):
            image = opened[..., sample_index]
        else:
            image = opened
        dlp.update(image_size=image.nbytes)

    def next(self):
        for batch in super().next():
            yield batch

    @dlp.log
    def read_index(self, image_idx, step):
        dlp.update(step=step)
        return super().read_index(image_idx, step)

    @dlp.log
    def finalize(self):
        # FormatReader.finalize walks a file map DLIO 2.0.0 never sets; close what is open here
        for filename, opened in list(self.open_file_map.items()):
            if opened is not None:
                self.close(filename)
                self.open_file_map[filename] = None

    def is_index_based(self):
        return True

    def is_iterator_based(self):
        return True
