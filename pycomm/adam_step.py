"""torch's Adam / AdamW step on CPU in one pass (pycomm::adam_step_: See Note [Adam in one
pass, with torch's bits] in csrc/grad/adam_cpu.cpp), where it gives torch's bits: the step
of pycomm.optim's classes and of pycomm.ZeroRedundancyOptimizer's pieces. It imports
neither; both import it.

Note [Probing the one-pass Adam]
The kernel repeats the rounding of each of torch's elementwise operations as ATen's float
kernels do it on the builds it was checked on, but that is a property of a torch build (a
fused multiply-add in a compiled vector loop, MKL's square root), not of torch's API. So it
is used only for an optimizer that asks nothing beyond the plain update (no amsgrad,
maximize, capturable, differentiable, foreach or fused; float hyperparameters; float32 CPU
tensors; no step hooks where the kernel is called in place of step(): reason()), and
only after a probe: the first time a form of update is met in a process (the class,
whether weight decay is applied, which branch torch's lerp takes), a few tensors of lengths
that cross vectors, remainders and the kernel's chunks and blocks are stepped three times
by the optimizer class's own step (without torch's hook wrapper, so no user hook runs)
and by the kernel, from the same state (a
quarter of each gradient zero, where the kernel avoids MKL's slow path: Note [Zeros around
the square root]); the form is used only if every parameter and state tensor agrees
bitwise. Otherwise the optimizer's own step runs, and `reason()` (or, inside an
optimizer's own step, `step_reason()`: pycomm/optim.py) says why. The state stays
torch's (the same keys, dtypes and values), so checkpoints do not see which step ran.
Checked so: torch 2.13's CPU wheel under ATen's AVX512, AVX2 and default kernels
(ATEN_CPU_CAPABILITY), against the kernel's AVX2 build for the first two and its portable
build for the third; torch 2.11 (cu130) on a GPU machine's CPU, under AVX512 and default.

Note [Deciding once, checking each step]
A step (try_step) does not walk the parameters to decide whether the kernel applies. The
decision has three parts, each checked where what it reads can change:
- Each step, per group (decide): ONE_PASS, the step hooks (the optimizer's and torch's
  global ones, where the kernel is called in place of step()), a wrapped step(), the
  class, and each group's options (options_reason: the flags, the hyperparameters'
  types, beta1, the probed form). A scheduler writes group["lr"] every step, and a user
  may set amsgrad, maximize, foreach or a Tensor lr between any two steps: a few keys of
  each group cost little, and this part is never stale. The probe's verdicts are kept
  for the process, whose ATen kernels are chosen when it starts (ATEN_CPU_CAPABILITY).
- Remembered (decide): the walk of every parameter, its gradient and its state
  (_params_reason), redone only when the optimizer's layout is not the one the last walk
  passed (_layout): the param_groups list, each group and its params list, by identity
  (add_param_group appends a group, load_state_dict makes new ones), each params list's
  length, and `optim.state` (replaced, or states made). A walk that finds a reason is
  not kept: the step it refuses runs torch's own step, which loops over the parameters
  in Python as the walk does, and the reason may be one step's gradient. Nor is a walk
  kept past a step try_step refused: torch's own step, run then, may make states the
  kernel does not take.
- Each step, in C++ (try_step): the gradients (a step's data: None, sparse, another
  dtype, not contiguous) and whatever changes in place under a layout that stays (a
  parameter's .data cast or moved, a state tensor replaced) are checked by the kernel,
  which checks every tensor before it writes any (check_adam_tensor in
  csrc/grad/adam_cpu.cpp); step() keeps the states it made only once the kernel ran. A
  refusal, or any error before it, so leaves the optimizer as it was: the walk names the
  reason and torch's own step runs. An error the walk finds no reason for is raised.
So the remembered walk never decides the bits: what the kernel cannot take is refused
each step, by the options or by the kernel; what only the walk sees (a state's keys, a
parameter without a gradient) does not change torch's update. A gradient check in
Python would cost what the walk costs, every step; the kernel's costs nothing beside its
pass over memory.
"""

from __future__ import annotations

import struct
from typing import Optional

import torch
from torch.autograd.graph import increment_version
from torch.optim import Adam, AdamW, Optimizer
from torch.optim import optimizer as torch_optimizer

ONE_PASS = True  # False: every optimizer steps itself (the tests of blocks set it)
ONE_PASS_STEP = "pycomm one-pass Adam"  # an optimizer's step_kernel where the kernel ran
CLASSES = (Adam, AdamW)  # exactly these: a subclass may step otherwise
_OFF = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")
_PROBE_LENGTHS = (1, 7, 37, 4099, (1 << 15) + 1001)  # the kernel's block is 1 << 15
_kernel = torch.ops.pycomm.adam_step_
_verdicts: dict[tuple, Optional[str]] = {}  # update form -> None (agrees) or why not
_WALKED = "_one_pass_walked"  # the optimizer's attribute: the layout its last walk passed


def _scalar_dtype() -> torch.dtype:
    """The dtype of torch's state["step"] on its for-loop path."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _form(cls: type, group: dict) -> tuple:
    decoupled = cls is AdamW or group.get("decoupled_weight_decay", False)
    weight = struct.unpack("f", struct.pack("f", 1 - group["betas"][0]))[0]  # as ATen's
    return cls, decoupled, group["weight_decay"] != 0, abs(weight) < 0.5


def _global_hooks() -> bool:
    return bool(getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_post_hooks", None))


def options_reason(cls: type, groups: list[dict]) -> Optional[str]:
    """Why parameter groups of optimizer class `cls` cannot take the one-pass step (None:
    they can, as far as their options go); probes each new form of update (Note [Probing
    the one-pass Adam])."""
    if not ONE_PASS:
        return "adam_step.ONE_PASS is off"
    cls = getattr(cls, "one_pass_of", cls)  # pycomm.optim's classes step as torch's
    if cls not in CLASSES:
        return f"{getattr(cls, '__name__', cls)} is not torch's Adam or AdamW"
    for i, group in enumerate(groups):
        on = [key for key in _OFF if group.get(key)]
        if on:
            return f"param_groups[{i}] sets {', '.join(on)}"
        numbers = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
        if not all(isinstance(x, (float, int)) and not isinstance(x, bool) for x in numbers):
            return f"param_groups[{i}] has a tensor hyperparameter"
        if group["betas"][0] == 1:
            return f"param_groups[{i}] has beta1 = 1 (torch's step divides by 1 - beta1^step)"
        form = _form(cls, group)
        if form[2] and not form[1]:
            return f"param_groups[{i}]: Adam's L2 weight decay (not decoupled)"
        if form not in _verdicts:
            _verdicts[form] = _probe(cls, group)
        if _verdicts[form] is not None:
            return _verdicts[form]
    return None


def _dense_cpu(t: torch.Tensor, dtypes: tuple = (torch.float32,)) -> bool:
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype in dtypes
            and t.device.type == "cpu" and t.is_contiguous())


def reason(optim: Optimizer) -> Optional[str]:
    """Why `optim.step()` must run itself rather than the one-pass step called in its
    place (None: it need not): its hooks, a wrapped step (an LR scheduler built on it
    counts its calls), then step_reason."""
    return _call_reason(optim) or step_reason(optim, type(optim))


def _call_reason(optim: Optimizer) -> Optional[str]:
    """What keeps a call of the kernel from standing in for `optim.step()`."""
    if (getattr(optim, "_optimizer_step_pre_hooks", None) is None
            or getattr(optim, "_optimizer_step_post_hooks", None) is None):
        return "this torch's optimizer keeps its step hooks elsewhere"
    if optim._optimizer_step_pre_hooks or optim._optimizer_step_post_hooks:
        return "optimizer step hooks are registered"
    if _global_hooks():
        return "global optimizer step hooks are registered"
    if "step" in vars(optim):
        return "its step() is wrapped (an LR scheduler built on it, say)"
    return None


def step_reason(optim: Optimizer, cls: type) -> Optional[str]:
    """Why the one-pass step cannot step `optim` as optimizer class `cls` steps it (None:
    it can): a tensor the kernel does not take (the parameters, their gradients and the
    state held: contiguous float32 on CPU; the step counter float32 or float64, as a
    loaded checkpoint may hold it otherwise), after options_reason."""
    return options_reason(cls, optim.param_groups) or _params_reason(optim)


def _params_reason(optim: Optimizer) -> Optional[str]:
    """The walk of step_reason: each parameter, its gradient and its state."""
    for group in optim.param_groups:
        for p in group["params"]:
            if not _dense_cpu(p):
                return (f"a parameter of {p.dtype} on {p.device}"
                        f"{'' if p.is_contiguous() else ', not contiguous'}: the one-pass "
                        f"step takes contiguous float32 on CPU")
            if p.grad is not None and not _dense_cpu(p.grad):
                return "a gradient that is not contiguous float32 on CPU"
            state = optim.state.get(p)
            if state:
                if set(state) != {"step", "exp_avg", "exp_avg_sq"}:
                    return f"a state of {sorted(state)}"
                if not (_dense_cpu(state["exp_avg"]) and _dense_cpu(state["exp_avg_sq"])):
                    return "a state tensor that is not contiguous float32 on CPU"
                if not (_dense_cpu(state["step"], (torch.float32, torch.float64))
                        and state["step"].numel() == 1):
                    return (f"a step counter of {state['step'].dtype} on "
                            f"{state['step'].device}")
    return None


def decide(optim: Optimizer, cls: Optional[type] = None) -> Optional[str]:
    """Why the one-pass step cannot step `optim` now (None: as far as its options, hooks
    and remembered walk go, it can): reason(optim) where the kernel is called in place of
    optim.step() (cls None), else step_reason(optim, cls); the parameters' walk made only
    when the layout changed (Note [Deciding once, checking each step])."""
    why = _call_reason(optim) if cls is None else None
    why = why or options_reason(cls or type(optim), optim.param_groups)
    if why is not None:
        return why
    walked = getattr(optim, _WALKED, None)
    layout = _layout(optim)
    if walked is not None and _same(walked, layout):
        return None
    why = _params_reason(optim)
    if why is None:
        setattr(optim, _WALKED, layout)
    return why


def try_step(optim: Optimizer, cls: Optional[type] = None) -> Optional[str]:
    """optim.step() by the one-pass kernel where decide(optim, cls) lets it and the
    kernel takes this step's tensors: None. Otherwise why not, nothing written: the
    caller runs torch's own step. See Note [Deciding once, checking each step]."""
    why = decide(optim, cls)
    if why is None:
        try:
            step(optim)
        except Exception:
            why = step_reason(optim, cls or type(optim))
            if why is None:
                raise
        else:
            setattr(optim, _WALKED, _layout(optim))  # the states it made: torch's three
            return None
    forget(optim)
    return why


def forget(optim: Optimizer) -> None:
    """Drop the remembered walk of `optim`: the next decide() walks its parameters."""
    vars(optim).pop(_WALKED, None)


def _layout(optim: Optimizer) -> tuple[tuple, tuple]:
    """What a walk of `optim`'s parameters is remembered by (Note [Deciding once, checking
    each step]): the groups and their params lists, held and compared by identity, and
    numbers: the state's id (not held: a state replaced must not stay in memory; its new
    groups show a load_state_dict) and length, each params list's length."""
    groups = optim.param_groups
    return ((groups, *groups, *[g["params"] for g in groups]),
            (id(optim.state), len(optim.state), *[len(g["params"]) for g in groups]))


def _same(a: tuple[tuple, tuple], b: tuple[tuple, tuple]) -> bool:
    return (len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0]))
            and a[1] == b[1])


@torch.no_grad()
def step(optim: Optimizer) -> None:
    """optim.step() for an optimizer `reason(optim)` passed: the state made and advanced
    as torch's for-loop Adam makes and advances it. Where it raises (the kernel refused a
    tensor), nothing was written: not even the states it made are kept."""
    params, grads, exp_avgs, exp_avg_sqs, steps, hyper = [], [], [], [], [], []
    made = []
    for group in optim.param_groups:
        row = [float(group["lr"]), *map(float, group["betas"]), float(group["eps"]),
               float(group["weight_decay"])]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider "
                                   "SparseAdam instead")
            state = optim.state.get(p)
            if not state:
                state = {"step": torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu"),
                         "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                made.append((p, state))
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            hyper.append(row)
    if params:
        _kernel(params, grads, exp_avgs, exp_avg_sqs, steps,
                torch.tensor(hyper, dtype=torch.float64))
        for p, state in made:  # in place where torch's step finds an empty state
            optim.state.setdefault(p, {}).update(state)
        for written in (params, exp_avgs, exp_avg_sqs, steps):  # as torch's in-place ops
            for t in written:  # do, so autograd sees a saved tensor changed
                increment_version(t)


def _probe(cls: type, group: dict) -> Optional[str]:
    """None when the kernel steps like `cls` with `group`'s options, bit for bit; else
    what differed (Note [Probing the one-pass Adam])."""
    try:
        return _compare(cls, group)
    except Exception as e:  # noqa: BLE001  (anything the probe meets is a reason not to)
        return f"the probe of the one-pass step failed: {type(e).__name__}: {e}"


def hookless_step(cls: type):
    """`cls.step` without the hook wrapper torch's Optimizer puts on a class."""
    fn = cls.step
    return fn.__wrapped__ if getattr(fn, "hooked", False) else fn


def _compare(cls: type, group: dict) -> Optional[str]:
    generator = torch.Generator().manual_seed(1234)
    options = {k: v for k, v in group.items() if k != "params"}
    theirs = [torch.randn(n, generator=generator, dtype=torch.float32)
              for n in _PROBE_LENGTHS]
    ours = [t.clone() for t in theirs]
    reference = cls([dict(options, params=theirs)])
    mine = cls([dict(options, params=ours)])
    for k in range(3):
        for a, b in zip(theirs, ours):
            a.grad = torch.randn(a.shape, generator=generator, dtype=torch.float32)
            a.grad *= 10.0 ** (k - 1)
            a.grad[: a.numel() // 4] = 0.0  # exp_avg_sq stays zero there, and -0.0 once
            a.grad[a.numel() // 4 - 1: a.numel() // 4] = -0.0
            b.grad = a.grad.clone()
        hookless_step(cls)(reference)  # a user's global step hooks are not called
        step(mine)
    for a, b in zip(theirs, ours):
        sa, sb = reference.state[a], mine.state[b]
        if set(sa) != set(sb):
            return f"{cls.__name__}'s state holds {sorted(sa)}, the one-pass step {sorted(sb)}"
        for key in sa:
            x, y = sa[key], sb[key]
            if x.dtype != y.dtype or not torch.equal(x, y):
                return (f"the one-pass step differs from {cls.__name__}.step() in this torch "
                        f"build ({key} of a {a.numel()}-element probe)")
        if not torch.equal(a, b):
            return (f"the one-pass step differs from {cls.__name__}.step() in this torch "
                    f"build (a {a.numel()}-element probe's parameter)")
    return None
