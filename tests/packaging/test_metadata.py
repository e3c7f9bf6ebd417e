"""The package's metadata says what is true (CONTRIBUTING.md, Versions and releases): one
version in pycomm/_version.py, CITATION.cff and the CHANGELOG's newest release, with the
same date; classifiers for the Python versions requires-python admits and the OS it
runs on; no web address the project does not have."""

from __future__ import annotations

import re

import pytest

from pycomm import __version__
from tests.support.paths import REPO

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11")
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CITATION = (REPO / "CITATION.cff").read_text()
CHANGELOG = (REPO / "CHANGELOG.md").read_text()


def _cff(key: str) -> str:
    found = re.search(rf"^{key}:\s*\"?([^\"\n]+)\"?\s*$", CITATION, re.M)
    assert found, f"CITATION.cff has no top-level {key}"
    return found.group(1).strip()


def test_one_version_one_date():
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", CHANGELOG, re.M)
    assert released, "the CHANGELOG names no release ('## [X.Y.Z] - YYYY-MM-DD')"
    newest, date = released[0]
    assert __version__ == newest == _cff("version"), (__version__, newest, _cff("version"))
    assert _cff("date-released") == date
    assert CHANGELOG.index("## [Unreleased]") < CHANGELOG.index(f"## [{newest}]")


def test_classifiers_follow_requires_python_and_the_platform():
    floor = re.fullmatch(r">=3\.(\d+)", PROJECT["requires-python"])
    assert floor, PROJECT["requires-python"]
    classifiers = PROJECT["classifiers"]
    minors = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert minors and minors[0] == int(floor.group(1)), (minors, floor.group(0))
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers), \
        "the license is the SPDX `license` field (PEP 639), not a classifier"
    assert PROJECT["license"] == _cff("license") == "BSD-3-Clause"
    assert PROJECT["authors"] and PROJECT["keywords"]


def test_no_address_the_project_does_not_have():
    """No public home yet: no URL fields; README says how to get it (a clone)."""
    assert "urls" not in PROJECT
    assert not re.search(r"^(url|repository-code|repository):", CITATION, re.M)
