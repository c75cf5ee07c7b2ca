"""Build the codec's C kernels (docs/DESIGN.md "Native core"); all metadata lives in pyproject.toml.

One extension, built against the limited API of CPython 3.11 (abi3): the same
`_kernels.abi3.so` loads on every CPython >= 3.11, so a machine without a compiler
can use an artifact built elsewhere. `optional=True`: a checkout without a C compiler
still installs, and the codec falls back to its numpy reference path (with a warning).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "weightsync.codec._kernels",
            sources=["src/weightsync/codec/_kernels.c"],
            # The loops are headers included by _kernels.c (one translation unit).
            depends=["src/weightsync/codec/_kernels_sum.h", "src/weightsync/codec/_kernels_loops.h"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
