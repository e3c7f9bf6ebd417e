"""`pycomm-bench ddp --compile`: which implementations it times and what it compares (the
timing loop itself runs in tests/test_overlap_sweep.py's sweep and in recorded runs)."""

from pycomm.bench import ddp


def _row(impl, step, exposed, overlap):
    return ddp.Result("mlp", 1, "32 samples", impl, step, step * 0.7, step - exposed, exposed,
                      step, step - exposed, overlap)


def test_compile_times_both_compiled_and_pycomm_eager_for_its_overlap():
    assert ddp.Config().variants() == ("torch", "pycomm")
    assert ddp.Config(compile=True).variants() == ("torch+compile", "pycomm+compile",
                                                   "pycomm")
    assert ddp.Config(impls=("torch",), compile=True).variants() == ("torch+compile",)


def test_compiled_rows_are_compared_with_torch_compiled_and_overlap_with_eager():
    rows = {r.impl: r for r in (_row("torch+compile", 200.0, 80.0, float("nan")),
                                _row("pycomm+compile", 150.0, 20.0, 0.875),
                                _row("pycomm", 160.0, 30.0, 0.8))}
    lines = ddp._comparisons("mlp", rows)
    assert lines[0].startswith("# mlp: pycomm+compile/torch+compile step 0.750,"), lines
    assert "exposed 0.250" in lines[0], lines
    assert lines[-1] == "# mlp: pycomm overlap compiled 0.88 vs eager 0.80 (+0.07)", lines
    assert len(lines) == 2, lines  # eager pycomm has no eager torch row to be compared with
