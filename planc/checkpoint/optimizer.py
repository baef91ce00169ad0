"""Optimizer state in a planc checkpoint: `planc.save(model, dir, optimizer=opt)` and `planc.load_optimizer`.

The state goes through torch's own optimizer state dict for sharded models,
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` (keyed by parameter name, not by
the optimizer's integer ids; DTensor states keep their parameter's placements; FSDP2-sharded
parameters included), flattened (`state.<param>.exp_avg`, `param_groups.<param>.lr`) so that every
key is one tensor or value DCP can reshard on its own. It is written by `torch.distributed.checkpoint`
into `<dir>/optimizer/` inside the same atomic write as the model, so a checkpoint never holds a
model without the optimizer state it was saved with. `planc.json` records it (`"optimizer":
{"class": ..., "path": "optimizer"}`).

`load_optimizer` reads it back into an optimizer over a model `planc.load` built under any plan or
sizes (saved at 2 ranks, resumed at 4 or 1): DCP reads, from every saved rank's file, the slices
that overlap this rank's shards, as it does for the model. A fresh optimizer first gets its state
tensors allocated by torch (`get_optimizer_state_dict` takes one step with zero gradients and lr 0),
which are then overwritten.

Parameter groups (decay / no-decay, per-layer learning rates) are matched by parameter name: planc.json
records which parameters each saved group held, and the optimizer resumed into must group them the same
way (in any order of groups), else load_optimizer refuses it naming the first group that differs. Each
group then gets back the hyperparameters it was saved with (`lr`, `weight_decay`, `betas`, `eps`, and
an LR scheduler's `initial_lr`), whatever the fresh optimizer was built with.

`_StridedShard` states (a `packed_colwise` parameter's `exp_avg`) are written and read through the plain
`Shard` of the same dim, as the model's own tensors are (`state.py` says why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, cast

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from planc.checkpoint.applied import applied_plan
from planc.checkpoint.dcp import dcp_failures, open_checked
from planc.checkpoint.keys import last_line
from planc.checkpoint.atomic import agree
from planc.checkpoint.dcp_reader import CheckedReader, metadata_protocol, planner_for, warn_trusted
from planc.checkpoint.marker import read_marker, saved_under
from planc.checkpoint.state import dcp_layout, has_strided
from planc.errors import CheckpointError
from planc.runtime.data_parallel import settle_sharded

OPTIMIZER_DIR = "optimizer"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STATE, _GROUPS = "state.", "param_groups."


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """`module.QualName` of the optimizer's class: what planc.json records and load_optimizer compares."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def refuse_foreign_parameters(model: nn.Module, optimizer: Optimizer, what: str) -> None:
    """Every tensor the optimizer updates must be a parameter of `model` (state is keyed by parameter name)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(
            f"{what}: optimizer= takes a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise CheckpointError(
            f"{what}: {foreign} tensor(s) the {type(optimizer).__name__} updates are not parameters of this "
            f"{type(model).__name__}. Build the optimizer from this model's parameters after planc.load/planc.apply "
            "(`AdamW(model.parameters())`): planc shards parameters, so an optimizer built before holds the old ones."
        )


def _dcp_view(state: dict[str, Any]) -> dict[str, Any]:
    """The state as DCP must see it: `_StridedShard` DTensors as the `Shard` of the same dim (a collective)."""
    return {k: (dcp_layout(cast(DTensor, v.detach())) if has_strided(v) else v) for k, v in state.items()}


def refuse_unsavable_optimizer(model: nn.Module, optimizer: Optimizer, what: str) -> None:
    """An optimizer planc.save cannot write, refused before anything is written."""
    if isinstance(optimizer, torch.optim.Optimizer):
        settle_sharded(model, optimizer)
    refuse_foreign_parameters(model, optimizer, what)
    if not optimizer.state:
        # torch's get_optimizer_state_dict would take a zero step to make some: a resume from it would count a
        # step that never happened
        raise CheckpointError(
            f"{what}: the {type(optimizer).__name__} has taken no step yet, so it holds no state to save. "
            "Save after the first optimizer.step(), or leave out optimizer= (a fresh optimizer starts the same way)."
        )


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The flattened, DCP-ready optimizer state planc.save writes (a collective where states are strided)."""
    return _dcp_view(get_optimizer_state_dict(model, optimizer, options=_OPTIONS))


def write_optimizer(state: dict[str, Any], checkpoint: Path) -> None:
    """DCP writes every rank's optimizer shards into `<checkpoint>/optimizer` (a collective)."""
    dcp.save(state, checkpoint_id=str(checkpoint / OPTIMIZER_DIR))


def marker_entry(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """What planc.json records of the optimizer state beside the model: its class, where, and the parameter
    names of each param group (what load_optimizer matches groups by)."""
    return {"class": optimizer_class(optimizer), "path": OPTIMIZER_DIR, "groups": group_names(model, optimizer)}


def group_names(model: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """The parameter names of each of the optimizer's param groups, in the groups' order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"] if id(p) in names] for g in optimizer.param_groups]


def refuse_regrouped(saved: list[list[str]], current: list[list[str]], directory: str | os.PathLike[str]) -> None:
    """The optimizer's param groups must be the saved ones (by parameter names, in any order): else a group's
    hyperparameters would come back from another group's (a no-decay group decaying). CheckpointError naming
    the first group that differs. Only the parameters both hold are compared: another parameter set is
    reported by name later, with the state's keys."""
    ours = {n for names in current for n in names}
    where = {n: j for j, names in enumerate(saved) for n in names if n in ours}
    saved = [[n for n in names if n in where] for names in saved]
    current = [names for names in ([n for n in g if n in where] for g in current) if names]

    def show(names: list[str], limit: int = 3) -> str:
        return ", ".join(f"`{n}`" for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")

    for i, names in enumerate(current):
        origins = sorted({where[n] for n in names})
        if len(origins) == 1 and set(saved[origins[0]]) == set(names):
            continue
        if len(origins) > 1:
            split = "; ".join(
                f"saved group {j}: {show([n for n in names if where.get(n) == j])}" for j in origins
            )
            detail = f"holds parameters of {len(origins)} saved groups ({split})"
        else:
            missing = [n for n in saved[origins[0]] if n not in set(names)]
            detail = f"lacks {show(missing)}, which the checkpoint's group {origins[0]} held with them"
        raise CheckpointError(
            f"{directory} holds the state of an optimizer with {len(saved)} param group(s) "
            f"({'; '.join(f'group {j}: {len(g)} parameter(s), the first `{g[0]}`' for j, g in enumerate(saved) if g)}); "
            f"this optimizer has {len(current)}, grouped differently: its group {i} ({len(names)} parameter(s)) "
            f"{detail}. Each group's lr and weight_decay come from the checkpoint, so a regrouped optimizer would "
            "give some parameters another group's. Build the param groups as they were when saved."
        )
    if len(current) != len([g for g in saved if g]):  # the same parameters in fewer groups
        raise CheckpointError(
            f"{directory} holds the state of an optimizer with {len(saved)} param group(s); this optimizer has "
            f"{len(current)}. Build the param groups as they were when saved."
        )


def _param_names(keys: Iterable[str], prefix: str = _GROUPS) -> set[str]:
    """The parameter names in flattened `param_groups.<param>.<hyperparameter>` keys."""
    return {k[len(prefix):].rpartition(".")[0] for k in keys if k.startswith(prefix)}


def _param_of(key: str, names: set[str]) -> Optional[str]:
    """The parameter name in a flattened `state.<param>.<field>` key (the longest known name that fits)."""
    rest = key[len(_STATE):]
    while "." in rest:
        rest = rest.rpartition(".")[0]
        if rest in names:
            return rest
    return None


def _plan_load(target: dict[str, Any], saved: dict[str, Any]) -> tuple[dict[str, Any], set[str], list[str]]:
    """(the keys to read, the parameters the checkpoint has no state for, every mismatch) between the
    optimizer's fresh state and the saved one.

    The parameters must be the same set (by name) with the same global shapes. A parameter the saved
    optimizer had no state for (it never got a gradient) gets none here either; hyperparameters the saved
    param groups lack (e.g. `initial_lr`, set by an LR scheduler) keep their current value.
    """
    names, saved_names = _param_names(target), _param_names(saved)
    problems = []
    for name in sorted(names - saved_names)[:20]:
        problems.append(f"{name}: a parameter this optimizer updates; the checkpoint's optimizer did not")
    for name in sorted(saved_names - names)[:20]:
        problems.append(f"{name}: updated by the checkpoint's optimizer; not a parameter this optimizer updates")
    stateful = {_param_of(k, saved_names) for k in saved if k.startswith(_STATE)}
    plan: dict[str, Any] = {}
    for key, value in target.items():
        if key.startswith(_STATE):
            if _param_of(key, names) not in stateful:
                continue  # no state saved for that parameter (it never stepped): it starts without one
            meta = saved.get(key)
            if meta is None:
                problems.append(f"{key}: this optimizer keeps it, the checkpoint does not")
                continue
            if isinstance(value, torch.Tensor):
                if not isinstance(meta, TensorStorageMetadata):
                    problems.append(f"{key}: the checkpoint stores a {type(meta).__name__}, the optimizer a tensor")
                    continue
                if tuple(meta.size) != tuple(value.shape):
                    problems.append(
                        f"{key}: checkpoint shape {tuple(meta.size)}, optimizer shape {tuple(value.shape)} (global)"
                    )
                    continue
        elif key not in saved:
            continue  # a hyperparameter the saved groups lack keeps its current value
        plan[key] = value
    return plan, names - stateful, problems


def optimizer_reader(directory: Path, marker: dict[str, Any], trust_code: bool) -> CheckedReader:
    """The reader of the optimizer state planc.json (`marker`) points to, its `.metadata` read (planc's allow-list
    unless the user trusts the checkpoint's code); CheckpointError otherwise. The state lives in `optimizer/`
    inside the checkpoint, where planc.save writes it, never elsewhere (planc.json is as untrusted as the rest)."""
    entry = marker.get("optimizer") or {}
    if entry.get("path") != OPTIMIZER_DIR:
        raise CheckpointError(
            f"{directory / 'planc.json'}: the optimizer state is at {entry.get('path')!r}; planc.save writes it to "
            f"{OPTIMIZER_DIR!r} inside the checkpoint and reads it nowhere else. The checkpoint is damaged: save it again."
        )
    saved_dir = directory / OPTIMIZER_DIR
    reader = open_checked(saved_dir, protocol=metadata_protocol(marker), trust_code=trust_code,
                          what="the optimizer state")
    return reader


def optimizer_problems(directory: str | os.PathLike[str], *, trust_checkpoint_code: bool = False) -> list[str]:
    """What planc.load_optimizer would refuse in a checkpoint's optimizer state before matching it to an optimizer
    (`planc explain --checkpoint`): its metadata, its files, every non-tensor value; [] when it holds none."""
    directory = Path(directory)
    try:
        marker = read_marker(directory)
        if marker.get("optimizer"):
            reader = optimizer_reader(directory, marker, trust_checkpoint_code)
            saved = reader.read_metadata().state_dict_metadata
            reader.read_items(k for k, v in saved.items() if isinstance(v, BytesStorageMetadata))
    except CheckpointError as e:
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - torch's unpickler (trusted) raises anything
        return [f"{directory / OPTIMIZER_DIR}: {type(e).__name__}: {last_line(str(e)) or e}"]
    return []


def load_optimizer(model: nn.Module, optimizer: Optimizer, directory: str | os.PathLike[str], *,
                   trust_checkpoint_code: bool = False) -> None:
    """Restore `optimizer` (over `model`'s parameters, any plan or sizes) from a planc.save checkpoint.

    Every rank calls it. Raises the same `CheckpointError` on every rank, before anything is read, when
    the checkpoint holds no optimizer state, holds another optimizer class's, or is of another model or
    parameter set (each mismatched key named), or when its metadata or a hyperparameter is not plain data
    (dcp_reader.py; `trust_checkpoint_code=True` reads them with torch's own unpickler, and warns).
    """
    directory = Path(directory)
    what = f"planc.load_optimizer({str(directory)!r})"
    if trust_checkpoint_code:
        warn_trusted(directory, "planc.load_optimizer")
    compiled, _ = applied_plan(model, what)
    if isinstance(optimizer, torch.optim.Optimizer):
        settle_sharded(model, optimizer)  # an optimizer built after a forward whose backward has not run yet
    error = None
    marker: dict[str, Any] = {}
    entry: dict[str, Any] = {}
    try:
        marker = read_marker(directory)
        entry = marker.get("optimizer") or {}
        if not entry:
            raise CheckpointError(
                f"{directory} holds no optimizer state: it was saved by planc.save without optimizer=. Save with "
                "`planc.save(model, directory, optimizer=opt)` to resume training, or start a fresh optimizer."
            )
        if entry["class"] != optimizer_class(optimizer):
            raise CheckpointError(
                f"{directory} holds the state of a {entry['class']}, not of this {optimizer_class(optimizer)}: "
                "the state of one optimizer means nothing to another. Build the same optimizer class it was "
                "saved with, or start this one fresh."
            )
        if marker.get("model_type") != compiled.model_type:
            raise CheckpointError(
                f"{directory} holds the optimizer state of a `{marker.get('model_type')}` model, this model is a "
                f"`{compiled.model_type}` one. Load the model from that checkpoint (planc.load) and resume it."
            )
        refuse_foreign_parameters(model, optimizer, what)
        if "groups" in entry:  # checkpoints written before planc recorded the grouping cannot be checked
            refuse_regrouped(entry["groups"], group_names(model, optimizer), directory)
    except Exception as e:  # noqa: BLE001 - reported on every rank before any collective
        error = e
    agree(error, what)

    had_state = bool(optimizer.state)
    # allocates a fresh optimizer's state
    target: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=_OPTIONS))
    plan: dict[str, Any] = {}
    values: dict[str, Any] = {}
    stateless: set[str] = set()
    reader: Optional[CheckedReader] = None
    try:
        reader = optimizer_reader(directory, marker, trust_checkpoint_code)
        saved = reader.read_metadata().state_dict_metadata
        plan, stateless, problems = _plan_load(target, saved)
        if problems:
            raise CheckpointError(
                f"{directory} ({saved_under(marker)}): "
                f"its optimizer state does not fit this optimizer over this {type(model).__name__}: "
                f"{len(problems)} problem(s):\n    " + "\n    ".join(problems[:50])
                + "\nLoad the model from the same checkpoint (planc.load) and build the optimizer over all of its "
                "parameters, as it was built when saved."
            )
        # the non-tensor values (hyperparameters), read as plain data before DCP writes into any state tensor
        values = reader.read_items(k for k in plan if isinstance(saved.get(k), BytesStorageMetadata))
    except Exception as e:  # noqa: BLE001
        error = e
    try:
        agree(error, what)
    except CheckpointError:
        if not had_state:
            optimizer.state.clear()  # the zero state torch allocated above is not a resumed one
        raise

    assert reader is not None  # the ranks agreed that it was read
    strided = [k for k, v in plan.items() if has_strided(v)]  # a list: every rank redistributes in one order
    load_state = _dcp_view({k: v for k, v in plan.items() if k not in values})
    with dcp_failures(what):
        dcp.load(load_state, storage_reader=reader, planner=planner_for(reader))
    with torch.no_grad():
        for key in strided:
            target[key].to_local().copy_(load_state[key].redistribute(placements=target[key].placements).to_local())
    for key, value in {**load_state, **values}.items():
        if key not in strided:
            target[key] = value  # non-tensor values (hyperparameters) come back as new objects
    error = None
    try:
        set_optimizer_state_dict(model, optimizer, target, options=_OPTIONS)
    except Exception as e:  # noqa: BLE001 - e.g. param groups split differently than when saved
        error = e
    agree(error, what)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in stateless:
        if name in params:
            optimizer.state.pop(params[name], None)


__all__ = [
    "OPTIMIZER_DIR",
    "load_optimizer",
    "marker_entry",
    "group_names",
    "optimizer_class",
    "optimizer_problems",
    "optimizer_reader",
    "optimizer_state",
    "refuse_foreign_parameters",
    "refuse_unsavable_optimizer",
    "write_optimizer",
]
