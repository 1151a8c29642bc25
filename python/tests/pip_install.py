# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""pip install --no-build-isolation ./python into a fresh folder, then import it from there
and run a pass: the install path users take works. Exits 77 (skip) without pip."""
import importlib.util
import os
import shutil
import subprocess
import sys

source, target = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
if importlib.util.find_spec("pip") is None:
    print("no pip in this Python: skipped")
    sys.exit(77)
shutil.rmtree(target, ignore_errors=True)
# The install path is what is tested, not the module's speed or its menu (python.module and the
# others test those): -O0 and the one-entry menu build it fastest (one tiny pass runs on it).
build_env = dict(os.environ, EPMOE_CMAKE_ARGS="'-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG' "
                                              "-DEPMOE_PYTHON_MENU=mixtral")
subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation",
                       "--no-deps", "--target", target, source], env=build_env)
check = ("import sys, torch; from epmoe.torch import MoE; import epmoe; "
         "assert epmoe.__file__.startswith(sys.argv[1]), epmoe.__file__; "
         "m = MoE(8, 16, 4, 2, ranks=2); y, l = m(torch.randn(6, 8)); "
         "assert y.shape == (6, 8) and bool(torch.isfinite(y).all()); print('installed:', epmoe.__file__)")
env = dict(os.environ, PYTHONPATH=target)
subprocess.check_call([sys.executable, "-c", check, target], env=env, cwd=target)
