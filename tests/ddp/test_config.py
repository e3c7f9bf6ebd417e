"""One owner for each option (Note [Reducer options] in csrc/reducer/reducer.h): DDPConfig
is the only place an option is named with its default; the C++ reducer reads its own
options from the config by the same names. A field on one side only fails here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pycomm
from pycomm import _C
from tests.support.multirank import run_ranks

# DDPConfig's fields that the C++ reducer does not read, and who does.
PYTHON_SIDE = {
    "bucket_cap_mb": "bucket_byte_limits() -> assign_buckets (construction.py)",
    "bucket_cap_mb_list": "bucket_byte_limits() -> assign_buckets (construction.py)",
    "broadcast_buffers": "ForwardSync.sync_buffers (forward.py)",
    "init_sync": "module.py: verify_and_sync_states at construction",
    "init_sync_buffers": "module.py: the buffers of the construction-time broadcast",
    "shared_memory_gradients": "args.gradient_group",
    "hierarchical_allreduce": "args.gradient_group",
    "local_clip_max_norm": "clip.attach_local_clip",
    "local_clip_norm_type": "clip.attach_local_clip",
    "local_clip_error_if_nonfinite": "clip.attach_local_clip",
}


# DDPConfig's values parsed from several fields, which the reducer reads whole.
PARSED = {"wire_format": ("wire", "wire_error_feedback")}


def test_every_field_is_read_on_exactly_one_side():
    config = {f.name for f in dataclasses.fields(pycomm.DDPConfig)}
    cpp = set(_C.REDUCER_OPTIONS)
    assert len(cpp) == len(_C.REDUCER_OPTIONS), "an option is listed twice in C++"
    for value, fields in PARSED.items():
        assert value in cpp, f"{value} is parsed for the reducer, which does not read it"
        assert set(fields) <= config and not set(fields) & cpp, fields
        cpp = (cpp - {value}) | set(fields)
    assert cpp <= config, f"C++ reducer options without a DDPConfig field: {cpp - config}"
    assert not cpp & set(PYTHON_SIDE), cpp & set(PYTHON_SIDE)
    unowned = config - cpp - set(PYTHON_SIDE)
    assert not unowned, f"DDPConfig fields read by neither the reducer nor Python: {unowned}"
    assert set(PYTHON_SIDE) <= config, set(PYTHON_SIDE) - config


def _options_reach_the_reducer(rank, world_size):
    param = torch.nn.Parameter(torch.ones(4))
    cfg = pycomm.DDPConfig(gradient_as_bucket_view=True, timeline_steps=3)
    reducer = _C.Reducer([param], ["w"], [[0]], torch.distributed.group.WORLD, cfg)
    assert len(reducer.bucket_indices()) == 1

    @dataclasses.dataclass
    class Partial:  # a config without one of the reducer's fields
        gradient_as_bucket_view: bool = False

    with pytest.raises(AttributeError, match="the config has no field 'find_unused_parameters'"):
        _C.Reducer([param], ["w"], [[0]], torch.distributed.group.WORLD, Partial())


def test_the_reducer_reads_its_options_by_name_and_names_a_missing_one():
    run_ranks(_options_reach_the_reducer, 1)


def test_help_shows_every_field_with_its_documentation():
    import pydoc

    from pycomm.config import _field_docs

    text = pydoc.render_doc(pycomm.DDPConfig, renderer=pydoc.plaintext)
    docs = _field_docs(pycomm.DDPConfig)
    for field in dataclasses.fields(pycomm.DDPConfig):
        assert field.name in docs, f"DDPConfig.{field.name} has no docstring under it"
        first = " ".join(docs[field.name].split()[:6])
        assert f"{field.name} = {field.default!r}" in text
        assert first in " ".join(text.replace("|", " ").split()), field.name
