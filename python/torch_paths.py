# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Writes what CMake needs to build against the installed torch (python/CMakeLists.txt)."""
import sys
import sysconfig

import torch
import torch.utils.cpp_extension as ext


def cmake_list(items):
    return ";".join(str(i) for i in items)


with open(sys.argv[1], "w") as out:
    out.write(f'set(EPMOE_TORCH_INCLUDE_DIRS "{cmake_list(ext.include_paths())}")\n')
    out.write(f'set(EPMOE_TORCH_LIBRARY_DIRS "{cmake_list(ext.library_paths())}")\n')
    out.write(f"set(EPMOE_TORCH_CXX11_ABI {int(torch._C._GLIBCXX_USE_CXX11_ABI)})\n")
    out.write(f'set(EPMOE_TORCH_VERSION "{torch.__version__}")\n')
    out.write(f'set(EPMOE_PYTHON_INCLUDE_DIR "{sysconfig.get_paths()["include"]}")\n')
    out.write(f'set(EPMOE_PYTHON_EXT_SUFFIX "{sysconfig.get_config_var("EXT_SUFFIX")}")\n')
