"""Process groups of a plan: one root DeviceMesh and its named submeshes (the collectives on them:
`planc.runtime.collectives`; the gloo exit drain building them registers: `planc.runtime.exit_drain`).

Every dimension planc uses is a view of one root mesh built once from the plan's sizes (torchtitan's
`ParallelDims.build_mesh`), so FSDP2 can concatenate any two of them ("Cannot concatenate overlapping
meshes" is what separate `DeviceMesh` objects gave). Rank `r` of a world of `tp * dp` ranks:

    root dims     ("dp_mod_ep", "dp_in_ep", "tp")   sizes (world / ep, ep / tp, tp)   when ep_size > 1
                  ("dp", "tp")                      sizes (dp, tp)                    when ep_size == 1
    tp            the tp consecutive ranks holding one batch (tp_rank = r % tp)
    dp            ("dp_mod_ep", "dp_in_ep") flattened: the dp replicas, one rank per replica (dense FSDP/replicate)
    ep            ("dp_in_ep", "tp") flattened: ep consecutive ranks (ep_rank = r % ep); with ep == tp it
                  is the tp group, with ep > tp it spans ep / tp replicas (only all_to_all moves tokens there)
    efsdp         "dp_mod_ep": the world / ep ranks holding the *same* experts (ep_rank equal): the experts'
                  data-parallel dimension (FSDP shards them over it, replicate averages over it)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from planc.errors import ApplyError
from planc.runtime.exit_drain import destroy_groups_at_exit
from planc.spec.sizes import check_sizes, mesh_dims

if TYPE_CHECKING:
    from planc.spec.model import Parallel


@dataclass(frozen=True)
class Groups:
    """The meshes and process groups one rank uses: TP styles take `tp_mesh`, EP runtimes the EP group,
    the data-parallel step `dp_mesh` and `efsdp_mesh`. Every mesh is a submesh of `root`."""

    root: DeviceMesh  # see the module docstring for its dims
    dp_mesh: DeviceMesh
    tp_mesh: DeviceMesh
    ep_mesh: DeviceMesh
    efsdp_mesh: Optional[DeviceMesh]  # the ranks holding the same experts; None when ep_size == 1
    tp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    ep_group: dist.ProcessGroup
    ep_rank: int
    ep_size: int
    dp_size: int = 1

    def view(self, name: str) -> DeviceMesh:
        """A named view of the root: `dp`, `tp`, `ep` or `efsdp` (`planc.device_mesh(model, name)`)."""
        views = {"dp": self.dp_mesh, "tp": self.tp_mesh, "ep": self.ep_mesh, "efsdp": self.efsdp_mesh}
        view = views.get(name)
        if view is None:
            raise ApplyError(
                f"planc.device_mesh: no `{name}` view at these sizes; the views are "
                f"{', '.join(k for k, v in views.items() if v is not None)} (efsdp only with ep_size > 1)."
            )
        return view

    @property
    def mesh(self) -> DeviceMesh:
        """The ("dp", "tp") view of the root (what `planc.apply(mesh=...)` accepted before the root had more dims)."""
        return DeviceMesh._concatenate([self.dp_mesh, self.tp_mesh])

    @property
    def shares_batch(self) -> bool:
        """Every rank of the EP group holds the same batch (the EP group is the TP group)."""
        return dist.get_process_group_ranks(self.tp_group) == dist.get_process_group_ranks(self.ep_group)


def device_type() -> str:
    """`cuda` when the default backend is NCCL, else `cpu` (gloo)."""
    return "cuda" if _nccl() else "cpu"


def _nccl() -> bool:
    return dist.is_initialized() and "nccl" in str(dist.get_backend())


def rank_device(device: Union[None, str, torch.device] = None) -> torch.device:
    """This rank's device, the one answer for every runtime step that needs one: the collectives' flag
    tensors (apply's agreement, checkpoint agreement), the shards `planc.load` fills, the DCP fill.

    `device` when the caller gives one; else under NCCL `cuda:LOCAL_RANK` (torchrun's GPU for this
    process; the current CUDA device when LOCAL_RANK is unset or names a GPU this process cannot see);
    else the CPU (gloo).
    """
    if device is not None:
        return torch.device(device)
    if _nccl() and torch.cuda.is_available():
        local = os.environ.get("LOCAL_RANK", "")
        index = int(local) if local.isdigit() and int(local) < torch.cuda.device_count() else None
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return torch.device("cpu")


def build_groups(parallel: Parallel, mesh: Optional[DeviceMesh] = None) -> Groups:
    """The `Groups` of `parallel` (a `planc.spec.model.Parallel`) on this world, or on the caller's `mesh`.

    Every rank must call this (it creates process groups). A world that does not match the plan's
    sizes raises the same ApplyError on every rank, before any group is created. `mesh`: the root
    mesh planc would build (`planc.spec.sizes.mesh_dims`), or a ("dp", "tp") mesh of the plan's sizes (its dp dim is
    unflattened into the EP dims), or a 1-D mesh of `tp_size` ranks when the world is one TP group.
    """
    world = dist.get_world_size()
    tp, ep, dp = parallel.tp_size, parallel.ep_size, parallel.dp_size
    problems = check_sizes(tp, ep, dp, world if mesh is None else None)
    if problems:
        raise ApplyError(f"planc.runtime.mesh: {problems[0].message}. {problems[0].hint}.")
    destroy_groups_at_exit()
    sizes, names = mesh_dims(tp, ep, dp)
    if mesh is None:
        root = init_device_mesh(device_type(), sizes, mesh_dim_names=names)
    else:
        root = _check_caller_mesh(mesh, tp, ep, dp, world)
    if ep > 1:
        dp_mesh = _flattened(root, ("dp_mod_ep", "dp_in_ep"), "dp")
        ep_mesh = _flattened(root, ("dp_in_ep", "tp"), "ep")
        efsdp_mesh = root["dp_mod_ep"]
    else:
        dp_mesh, efsdp_mesh = root["dp"], None
        ep_mesh = _single_rank_mesh(root)
    tp_mesh = root["tp"]
    return Groups(
        root=root,
        dp_mesh=dp_mesh,
        tp_mesh=tp_mesh,
        ep_mesh=ep_mesh,
        efsdp_mesh=efsdp_mesh,
        tp_group=tp_mesh.get_group(),
        tp_rank=tp_mesh.get_local_rank(),
        tp_size=tp_mesh.size(),
        ep_group=ep_mesh.get_group(),
        ep_rank=ep_mesh.get_local_rank(),
        ep_size=ep_mesh.size(),
        dp_size=dp,
    )


def _flattened(root: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """`root[dims]` flattened as `name`, kept on the root (torch deprecates slicing a flattened dim back out of
    its root by name: the views are bookkept), so a root passed to planc again gets the same views."""
    views = root.__dict__.setdefault("_planc_views", {})
    if name not in views:
        try:
            views[name] = root[dims]._flatten(name)
        except ValueError as e:
            raise ApplyError(
                f"planc.runtime.mesh: the mesh passed to planc.apply already has a flattened `{name}` dim planc did "
                f"not make ({e}); pass the mesh before flattening it, or leave `mesh` out and planc builds it."
            ) from None
    flattened: DeviceMesh = views[name]
    return flattened


def _single_rank_mesh(root: DeviceMesh) -> DeviceMesh:
    """The EP mesh at ep_size 1 (each rank its own group; Mega MoE binds its kernel to it): a size-1 dim
    unflattened out of the root's tp dim, so it stays a view of the root."""
    views = root.__dict__.setdefault("_planc_views", {})
    if "ep" not in views:
        # the dim by index: torch 2.11's _unflatten rejects a dim given by name
        names = root.mesh_dim_names
        assert names is not None  # build_groups names every dim of the root
        tp_dim = names.index("tp")
        views["ep"] = root._unflatten(tp_dim, (root["tp"].size(), 1), ("tp_", "ep"))["ep"]
    ep: DeviceMesh = views["ep"]
    return ep


def _check_caller_mesh(mesh: DeviceMesh, tp: int, ep: int, dp: int, world: int) -> DeviceMesh:
    """The root from the caller's mesh: planc's own dims as they are, a ("dp", "tp") mesh with its dp dim
    unflattened (its own "dp" kept as the dp view), a 1-D mesh of the whole world as ("dp"=1, "tp");
    anything else is an ApplyError."""
    sizes, names = mesh_dims(tp, ep, dp)
    got = tuple(mesh.mesh_dim_names or ())
    if mesh.size() != world:
        raise ApplyError(
            f"planc.runtime.mesh: the mesh passed to planc.apply has {mesh.size()} ranks in a world of {world}; "
            f"the plan wants tp_size={tp}, ep_size={ep}, dp_size={dp}. Leave `mesh` out and planc builds it."
        )
    if mesh.ndim == 1:
        if mesh.size() != tp:
            raise ApplyError(
                f"planc.runtime.mesh: the 1-D mesh passed to planc.apply has {mesh.size()} ranks in a world of "
                f"{world}, the plan wants tp_size={tp}, dp_size={dp}. Pass a 2-D mesh named ('dp', 'tp'), "
                "or leave `mesh` out and planc builds it."
            )
        mesh = mesh._unflatten(0, (1, tp), ("dp", "tp"))
        got = ("dp", "tp")
    if got == names and tuple(mesh.shape) == sizes:
        return mesh
    if got == ("dp", "tp"):
        if mesh["tp"].size() != tp or mesh["dp"].size() != dp:
            raise ApplyError(
                f"planc.runtime.mesh: the mesh passed to planc.apply is dp={mesh['dp'].size()} x "
                f"tp={mesh['tp'].size()} over {mesh.size()} of {world} ranks, the plan wants dp={dp} x tp={tp}. "
                "Make the mesh match the plan's `parallel` sizes."
            )
        if ep == 1:
            return mesh
        root = mesh._unflatten(got.index("dp"), sizes[:2], names[:2])
        root.__dict__.setdefault("_planc_views", {})["dp"] = mesh["dp"]  # the caller's dp is the flattened view
        return root
    raise ApplyError(
        f"planc.runtime.mesh: the mesh passed to planc.apply has dims {got} of sizes {tuple(mesh.shape)}; planc "
        f"needs {names} of sizes {sizes} (its root mesh for these sizes) or a 2-D mesh named ('dp', 'tp'). "
        "Build it with init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), or leave `mesh` out."
    )
