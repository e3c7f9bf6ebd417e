"""What a user sees when something pycomm needs is missing: one message naming what to
install, not a traceback from deep inside an import or pip's generic build error."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import REPO


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_pycomm_lightning_without_lightning_names_the_extra():
    # sys.modules[name] = None makes `import name` raise ModuleNotFoundError.
    out = _run("import sys; sys.modules['lightning'] = None\n"
               "import pycomm\n"
               "try:\n"
               "    import pycomm.lightning\n"
               "except ModuleNotFoundError as e:\n"
               "    print('MISSING', e.name, '|', e)\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MISSING lightning"), out.stdout
    assert "`integrations` extra" in out.stdout and "pip install lightning" in out.stdout


def test_setup_without_torch_says_to_build_without_isolation():
    out = _run("import sys; sys.modules['torch'] = None\n"
               "sys.argv = ['setup.py', '--version']\n"
               "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))")
    assert out.returncode != 0
    assert "--no-build-isolation" in out.stderr and "Install torch first" in out.stderr, out.stderr


def test_the_demo_op_is_not_top_level_api():
    out = _run("import pycomm; print(hasattr(pycomm, 'sum_squares'), "
               "callable(pycomm.ops.sum_squares), 'sum_squares' in pycomm.__all__)")
    assert out.stdout.split() == ["False", "True", "False"], out.stdout + out.stderr
