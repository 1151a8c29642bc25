# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""CTest's entry to pytest: exits 77 (CTest's skip code) when pytest is not installed, else
pytest's own code (5, no test collected, is a failure)."""
import importlib.util
import sys

if importlib.util.find_spec("pytest") is None:
    print("pytest is not installed: apt install python3-pytest (scripts/install-deps does)")
    sys.exit(77)
import pytest  # noqa: E402

sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
