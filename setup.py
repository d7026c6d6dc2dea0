"""The one compiled part: the streamed reader's columns-to-rows decode (orchestrator/data/_rows.c).
Optional: without a C compiler the install goes on and the reader uses numpy (the same values;
an epoch of the data_scale bench's reads took ~1.6x as long)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("orchestrator.data._rows", ["orchestrator/data/_rows.c"],
                             extra_compile_args=["-O3"], optional=True)])
