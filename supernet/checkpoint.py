"""Supernet training checkpoints: safetensors for tensors, JSON for everything else (no pickle).

    DIR/supernet.safetensors   the supernet's weights (with its hot-token map and training-only heads)
    DIR/optimizer.safetensors  AdamW moments per parameter name (exp_avg, exp_avg_sq, step)
    DIR/state.json             step, configs, space, entropy layer, target fingerprint, data dir

Written into a temporary directory and renamed into place, so an interrupted save never leaves a
half checkpoint; a resumed run loses at most the steps since the last save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from decode.errors import UserError

MODEL, OPTIM, STATE = "supernet.safetensors", "optimizer.safetensors", "state.json"


def save_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    directory = Path(directory)
    bad = [k for k, v in model.state_dict().items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:  # never replace a good checkpoint with NaN weights
        raise UserError(f"refusing to save a checkpoint with non-finite weights ({len(bad)} tensors, e.g. {bad[0]}); "
                        f"the last good one stays in {directory}")
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp / MODEL))
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                moments[f"{names[id(p)]}::{key}"] = torch.as_tensor(value).detach().contiguous().cpu()
    save_file(moments, str(tmp / OPTIM))
    (tmp / STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def recover(directory: Path) -> bool:
    """A save killed between its two renames leaves no `directory`, but `.tmp` (complete: state.json is
    written last) and/or `.old` (the previous checkpoint). Put the newest complete one back; -> recovered."""
    directory = Path(directory)
    if directory.exists():
        return False
    for candidate in (directory.with_name(directory.name + ".tmp"), directory.with_name(directory.name + ".old")):
        if (candidate / STATE).is_file() and (candidate / MODEL).is_file() and (candidate / OPTIM).is_file():
            os.replace(candidate, directory)
            return True
    return False


def read_state(directory: Path) -> dict:
    recover(directory)
    f = Path(directory) / STATE
    if not f.is_file():
        raise UserError(f"no supernet checkpoint in '{directory}' (missing {STATE}); train one with supernet.train")
    return json.loads(f.read_text())


def load_weights(directory: Path, model: torch.nn.Module) -> None:
    state = load_file(str(Path(directory) / MODEL))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise UserError(f"checkpoint '{directory}' does not fit this supernet: {str(err).splitlines()[0]}") from None


def load_optimizer(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    moments = load_file(str(Path(directory) / OPTIM))
    params = dict(model.named_parameters())
    for key, value in moments.items():
        name, field = key.split("::")
        p = params[name]
        value = value.to(p.device)
        optimizer.state[p][field] = value if field != "step" else value.to(torch.float32)
