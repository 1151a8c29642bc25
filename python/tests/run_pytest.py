# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""CTest's entry to pytest: exits 77 (CTest's skip code) when pytest is not installed or the
file skipped itself whole (pytest.importorskip of a missing package), else pytest's own code
(5, no test collected for another reason, is a failure)."""
import importlib.util
import sys


def main():
    if importlib.util.find_spec("pytest") is None:
        print("pytest is not installed: apt install python3-pytest (scripts/install-deps does)")
        return 77
    import pytest

    class Skips:
        """Counts what was skipped at collection (a module-level skip)."""

        skipped = 0

        def pytest_collectreport(self, report):
            if report.skipped:
                Skips.skipped += 1

    code = pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Skips()])
    return 77 if code == pytest.ExitCode.NO_TESTS_COLLECTED and Skips.skipped else int(code)


# Guarded: the tests' worker processes start by "spawn", which imports this main module again.
if __name__ == "__main__":
    sys.exit(main())
