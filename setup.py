"""Builds the compiled analytics kernels (pipelines/kernels/*.pyx, Cython) with the package.

Optional: where no C compiler is found the build goes on without them and the tracker, zones and lines run
their numpy code (same results; 8-10x the host CPU per frame at 20 objects, 4-5x at 100, measured by
`edge-agent bench --sections tracking`; README "Tracking, zones and events").
Everything else about the package is in pyproject.toml.
"""

import numpy
from setuptools import Extension, setup

KERNELS = ["tracking", "regions"]

setup(
    ext_modules=[
        Extension(
            f"pipelines.kernels.{name}",
            [f"pipelines/kernels/{name}.pyx"],
            include_dirs=[numpy.get_include()],  # numpy's C API: new arrays and their data without buffers
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            optional=True,
        )
        for name in KERNELS
    ]
)
