"""`.ci/run` runs the README's quick-start commands as tools/readme_commands.py reads
them: exactly two, the install (with the test extra, which pulls in the optional ones)
and the test run."""

import subprocess
import sys

import pytest

from tests.support.paths import REPO

ROOT = REPO


def test_ci_reads_the_two_quick_start_commands():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_commands.py"),
                          str(ROOT / "README.md")], capture_output=True, text=True, check=True)
    install, tests = out.stdout.splitlines()
    assert install.startswith("pip install torch==") and '-e ".[test]"' in install, install
    assert install.endswith("pycomm-bench"), install
    assert tests == "python -m pytest", tests


def test_the_test_extra_installs_the_optional_extras():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "pycomm[plot,integrations]" in extras["test"], extras["test"]
    assert extras["plot"] == ["matplotlib"]
