"""Every random number generator a run draws from (Python's, numpy's, torch's CPU and CUDA
generators): seeding them, and their state as data a checkpoint can hold
(``torch.load(weights_only=True)`` accepts tensors, numbers and strings, not numpy arrays)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's


def numpy_to_dict(state: tuple) -> dict[str, Any]:
    """A numpy RandomState state as tensors and numbers."""
    name, keys, pos, has_gauss, gauss = state
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def numpy_from_dict(d: dict[str, Any]) -> tuple:
    return d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["gauss"]


def state(device: torch.device) -> dict[str, Any]:
    """This process's generators, ``device``'s CUDA generator included when it is one."""
    out = {"python": random.getstate(), "numpy": numpy_to_dict(np.random.get_state()),
           "torch": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_state(saved: dict[str, Any], device: torch.device) -> None:
    random.setstate(saved["python"])
    np.random.set_state(numpy_from_dict(saved["numpy"]))
    torch.set_rng_state(saved["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], device)
