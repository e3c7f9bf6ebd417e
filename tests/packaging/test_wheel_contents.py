"""What the wheel ships: every pycomm package but the test harnesses of pycomm.testing
(several hosts from network namespaces, root only), which a clone keeps."""

from __future__ import annotations

import pytest
from setuptools import find_packages

from tests.support.paths import REPO


def test_the_wheel_leaves_the_testing_harness_out():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11")
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    shipped = set(find_packages(str(REPO), include=find["include"], exclude=find["exclude"]))
    assert {"pycomm", "pycomm.ddp", "pycomm.bench", "pycomm.overlap"} <= shipped, shipped
    assert not {p for p in shipped if p.startswith("pycomm.testing")}, shipped
    assert (REPO / "pycomm" / "testing" / "hosts.py").exists()
