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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert f"{project['name']}[plot,integrations,docs]" in extras["test"], extras["test"]
    assert extras["plot"] == ["matplotlib"]


def test_nothing_in_the_test_extra_needs_a_system_library():
    # mpi4py loads the system's libmpi on import and raises RuntimeError without it; under
    # the `test` extra it broke every Lightning Trainer on a machine without Open MPI.
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert not any(r.startswith("mpi4py") for r in extras["test"]), extras["test"]
    assert any(r.startswith("mpi4py") for r in extras["mpi"]), extras["mpi"]


def test_ci_runs_the_bare_pass_before_installing_any_system_package():
    script = (ROOT / ".ci" / "run").read_text()
    bare = script.index('eval "${commands[1]}"')
    assert script.index('eval "${commands[0]}"') < bare
    assert "apt-get" not in script[:bare], "a system package is installed before the bare pass"
    assert '"optional-dependencies"]["mpi"]' in script[bare:], "the mpi extra is not installed"


def test_the_distribution_name_cannot_be_taken_for_another_project():
    # "pycomm" on PyPI is an unrelated PLC library: the distribution has its own name, the
    # import stays `pycomm`.
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "pycomm-dp", project["name"]
    assert project["requires-python"] == ">=3.10", project["requires-python"]
