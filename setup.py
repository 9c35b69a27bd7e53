"""The one part of the build pyproject.toml does not hold: cachemw's optional C extension,
the hit path's trace writer (cachemw/_blocktrace.c; README "Seeing inside"). Optional: where
it cannot be compiled (no compiler, no Python headers) the install goes on without it and
cachemw.trace writes those events from Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cachemw._blocktrace", ["cachemw/_blocktrace.c"],
                             optional=True, extra_compile_args=["-O2"])])
