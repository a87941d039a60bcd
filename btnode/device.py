"""Turns a --device string into a torch.device, with a clear error when it does not exist here."""

from __future__ import annotations

import torch

from btnode.errors import DeviceError


def resolve_device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise DeviceError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"unsupported device {name!r}: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} requested but no CUDA GPU is available on this host")
    index = dev.index or 0
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {name!r} requested but this host has {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)
