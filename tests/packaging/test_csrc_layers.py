"""csrc/ is layered: comm (the c10d surface) <- shm (the shared-memory backend) <- reducer,
and grad (the fused gradient ops) stands alone; csrc/*.cpp (the module, the op schemas)
bind them all. Found by reading every `#include "layer/..."`, so a reach into a higher or
sideways layer fails here, not in a review."""

from __future__ import annotations

import re

from tests.support.paths import REPO

CSRC = REPO / "csrc"
ALLOWED = {"comm": {"comm"}, "grad": {"grad"}, "shm": {"comm", "shm"},
           "reducer": {"comm", "shm", "grad", "reducer"}}


def test_each_layer_includes_only_the_layers_below_it():
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((CSRC / layer).iterdir()):
            for target in re.findall(r'^#include "(\w+)/', path.read_text(), re.M):
                if target not in allowed:
                    wrong.append(f"{path.relative_to(REPO)} includes {target}/")
    assert not wrong, wrong
    assert {p.name for p in CSRC.iterdir() if p.is_dir()} == set(ALLOWED)
