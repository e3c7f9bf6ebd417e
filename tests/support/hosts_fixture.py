"""What every test across hosts shares: the skip when this machine cannot make hosts, and
the check that a test leaves no namespace, interface or UTS namespace behind."""

from __future__ import annotations

import os
import subprocess

import pytest

from pycomm.testing import hosts as hosts_mod

REASON = hosts_mod.available()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=f"no hosts: {REASON}")


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines() if ":" in line}


def _uts_files() -> set[str]:
    d = hosts_mod.UTS_DIR
    return set(os.listdir(d)) if os.path.isdir(d) else set()


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """After the test: no namespace of this process, no new interface in the machine's
    own namespace, no UTS namespace file."""
    if REASON is not None:
        yield
        return
    links = _links()
    yield
    mine = f"{hosts_mod.PREFIX}{os.getpid()}-"
    left = [n for n in hosts_mod.netns_names() if n.startswith(mine)]
    assert not left, f"namespaces left behind: {left}"
    assert _links() <= links, f"interfaces left behind: {_links() - links}"
    assert not {f for f in _uts_files() if f.startswith(mine)}, "UTS namespaces left behind"
