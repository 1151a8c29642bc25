# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Writes what CMake needs to build against the installed torch (python/CMakeLists.txt): its
headers, the full paths of its libraries and the pybind11 it bundles. Full paths, never
library names: a system libtorch (Debian's 1.13 in /usr/lib) must not be linked instead, nor
the system's pybind11 included (a mismatched libc10 dies with a bus error at import).
Exits 1 with the reason on stderr when this torch cannot be built against."""
import os
import sys
import sysconfig

import torch
import torch.utils.cpp_extension as ext

MIN_TORCH = (2, 5)  # transformers 5's floor; Debian 12's 1.13 is not supported


def cmake_list(items):
    return ";".join(str(i) for i in items)


def fail(why):
    sys.stderr.write(f"torch {torch.__version__} ({os.path.dirname(torch.__file__)}): {why}\n")
    sys.exit(1)


if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
    fail(f"epmoe needs torch >= {'.'.join(map(str, MIN_TORCH))}")
include_dirs, library_dirs = ext.include_paths(), ext.library_paths()
libraries = []
for name in ("c10", "torch", "torch_cpu", "torch_python"):
    found = [os.path.join(d, f"lib{name}.so") for d in library_dirs
             if os.path.exists(os.path.join(d, f"lib{name}.so"))]
    if not found:
        fail(f"no lib{name}.so in {cmake_list(library_dirs)}")
    libraries.append(found[0])
pybind11 = [d for d in include_dirs if os.path.exists(os.path.join(d, "pybind11", "pybind11.h"))]
if not pybind11:
    fail(f"no pybind11/pybind11.h in {cmake_list(include_dirs)} (torch bundles its own)")

with open(sys.argv[1], "w") as out:
    out.write(f'set(EPMOE_TORCH_INCLUDE_DIRS "{cmake_list(include_dirs)}")\n')
    out.write(f'set(EPMOE_TORCH_LIBRARY_DIRS "{cmake_list(library_dirs)}")\n')
    out.write(f'set(EPMOE_TORCH_LIBRARIES "{cmake_list(libraries)}")\n')
    out.write(f'set(EPMOE_PYBIND11_INCLUDE_DIR "{pybind11[0]}")\n')
    out.write(f"set(EPMOE_TORCH_CXX11_ABI {int(torch._C._GLIBCXX_USE_CXX11_ABI)})\n")
    out.write(f'set(EPMOE_TORCH_VERSION "{torch.__version__}")\n')
    out.write(f'set(EPMOE_PYTHON_INCLUDE_DIR "{sysconfig.get_paths()["include"]}")\n')
    out.write(f'set(EPMOE_PYTHON_EXT_SUFFIX "{sysconfig.get_config_var("EXT_SUFFIX")}")\n')
