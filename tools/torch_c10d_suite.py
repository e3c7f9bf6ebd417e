"""Run torch's own distributed test base against the "pycomm" backend, beside Gloo.

torch ships its distributed tests' body with the wheel
(torch.testing._internal.distributed.distributed_test, class _DistTestBase); pytorch's
test/distributed/test_distributed_spawn.py runs it for one backend named by $BACKEND. This
runs the same base with BACKEND=gloo, either as is (`--as gloo`, the reference) or with
every default process group that asks for Gloo made on pycomm's shared-memory backend
instead (`--as pycomm`): the tests then exercise pycomm's collectives through torch's own
assertions, Gloo's expectations included. Subgroups a test makes by name stay what it asks
for. Prints each test's outcome and the counts; `--json` keeps them. torch's test
utilities import `expecttest` (`pip install expecttest`; no extra of ours installs it).

    python tools/torch_c10d_suite.py --as pycomm -k test_all_reduce --exclude cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import unittest

if __name__ == "__main__":  # before torch's test module reads them
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "2")
    if "TEMP_DIR" not in os.environ:
        os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="pycomm-c10d-")
        os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)

import torch.distributed as dist  # noqa: E402

if os.environ.get("PYCOMM_C10D_AS") == "pycomm":  # in the runner and every spawned rank
    import pycomm  # noqa: F401  (registers the backend)

    _init = dist.init_process_group

    def _init_on_pycomm(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = "pycomm"
        return _init(*args, **kwargs)

    dist.init_process_group = _init_on_pycomm

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestOnBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as", dest="backend", choices=("gloo", "pycomm"), default="pycomm")
    p.add_argument("-k", action="append", default=[],
                   help="run only tests whose name holds this (repeatable)")
    p.add_argument("--exclude", action="append", default=[],
                   help="leave out tests whose name holds this (repeatable): cuda, nccl")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if os.environ.get("PYCOMM_C10D_AS") != ns.backend:  # children inherit the environment
        os.environ["PYCOMM_C10D_AS"] = ns.backend
        os.execv(sys.executable, [sys.executable, *sys.argv])
    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TestOnBackend)
             if (not ns.k or any(k in n for k in ns.k)) and not any(x in n for x in ns.exclude)]
    suite = unittest.TestSuite(TestOnBackend(n) for n in names)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    outcome = {n: "passed" for n in names}
    for case, _ in result.failures + result.errors:
        outcome[case._testMethodName] = "failed"
    for case, _ in result.skipped:
        outcome[case._testMethodName] = "skipped"
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    print(f"# {ns.backend}: {counts}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"as": ns.backend, "counts": counts, "tests": outcome}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
