"""The timing loop of every pycomm-bench measurement, written once.

`time_back_to_back` issues `iters` calls with one synchronization at the end (nccl-tests'
figure: the mean time per call); `time_each` times every call separately (the samples behind
p50/p99/min/max). On CUDA both use events on the current stream, which a synchronous
collective makes wait for the communication; on CPU the wall clock (`perf_counter`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

Step = Callable[[], object]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(step: Step, iters: int, device: torch.device) -> None:
    for _ in range(iters):
        step()
    synchronize(device)


def time_back_to_back(step: Step, iters: int, device: torch.device) -> float:
    """Mean seconds per call over `iters` calls issued back to back."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - begin) / iters


def time_each(step: Step, iters: int, device: torch.device) -> list[float]:
    """Seconds of each of `iters` calls, each one complete before the next starts."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(iters):
            start.record()
            step()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return samples
    samples = []
    for _ in range(iters):
        begin = time.perf_counter()
        step()
        samples.append(time.perf_counter() - begin)
    return samples
