# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""pip install --no-build-isolation ./python: builds epmoe._epmoe with the repository's CMake
project (python/CMakeLists.txt) against the torch of the Python running pip, and installs the
package. --no-build-isolation: the build must see the torch you will run with (an isolated
build environment has none, or another)."""
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        try:
            import torch  # noqa: F401
        except ImportError:
            sys.exit("epmoe: this Python cannot import torch: install torch first, and build "
                     "with pip install --no-build-isolation ./python (an isolated build "
                     "environment has no torch)")
        build = os.path.join(ROOT, "build", "pip")  # kept: a second install rebuilds little
        subprocess.check_call([
            "cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
            f"-DEPMOE_PYTHON={sys.executable}", "-DEPMOE_WITH_TORCH=ON",
            "-DEPMOE_BUILD_TESTS=OFF", "-DEPMOE_BUILD_EXAMPLES=OFF", "-DEPMOE_BUILD_BENCH=OFF",
            "-DEPMOE_WITH_MPI=OFF", "-DEPMOE_WITH_CUDA=OFF", "-DEPMOE_INSTALL=OFF",
            # the defaults said each time: the build folder is kept, and its cache keeps what
            # an earlier install's EPMOE_CMAKE_ARGS set (python.pip_install: -O0, one entry)
            "-DCMAKE_CXX_FLAGS_RELEASE=-O3 -DNDEBUG", "-DEPMOE_PYTHON_MENU=full",
            # more configure arguments, e.g. EPMOE_CMAKE_ARGS="-DEPMOE_WITH_BLAS=OFF"
            *shlex.split(os.environ.get("EPMOE_CMAKE_ARGS", ""))])
        jobs = str(max(1, os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", build, "--target", "_epmoe", "-j", jobs])
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(build, "python", "epmoe", os.path.basename(target)), target)


setup(
    name="epmoe",
    version="0.1.0",
    description="Expert-parallel Mixture-of-Experts layer (epmoe) for PyTorch",
    license="Apache-2.0",
    packages=["epmoe"],
    ext_modules=[Extension("epmoe._epmoe", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
)
