"""The dense device mesh under Lightning's dim names, as a model's ``configure_model`` reads it.

Lightning's ``ModelParallelStrategy`` hands the LightningModule a mesh whose dims are called
``"data_parallel"`` and ``"tensor_parallel"``; a model written for it applies torch's
``parallelize_module`` with ``self.device_mesh["tensor_parallel"]``. :func:`lightning_device_mesh`
builds the same view of a :class:`~lightning_moe.parallel.ParallelContext`'s dense mesh, with every
dense dim under Lightning's name (:data:`LIGHTNING_MESH_DIMS`): over the same process groups, with
the same rank map, so torch can combine its sub-meshes with the context's own (FSDP2's 2-D
sharding of a tensor-parallel DTensor does). Code that knows the context's names (``"tp"``,
``"dp"``) reads a DTensor's mesh through :func:`layout_dim_names`.

Asking the mesh for a dim it does not have raises a ``KeyError`` that lists the names it has and
says which one a ``ModelParallelStrategy`` model means (:class:`LightningDeviceMesh`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

from lightning_moe.parallel.layout.groups import ParallelContext

__all__ = ["LIGHTNING_MESH_DIMS", "LightningDeviceMesh", "layout_dim_names", "lightning_device_mesh"]

LIGHTNING_MESH_DIMS = {
    "pipeline_parallel": "pp", "data_parallel": "dp", "context_parallel": "cp", "tensor_parallel": "tp",
}
"""Lightning's name of each dense mesh dim -> the :class:`~lightning_moe.parallel.ParallelContext`
group of the same ranks, in the dense mesh's dim order."""


def layout_dim_names(mesh_dim_names: Sequence[str] | None) -> tuple[str, ...]:
    """``mesh_dim_names`` with Lightning's names replaced by the context's (``"tensor_parallel"`` -> ``"tp"``)."""
    return tuple(LIGHTNING_MESH_DIMS.get(name, name) for name in mesh_dim_names or ())


class LightningDeviceMesh(DeviceMesh):
    """A :class:`DeviceMesh` whose unknown-dim error names the dims it has and Lightning's convention.

    Only ``__getitem__`` differs; sub-meshes are plain ``DeviceMesh`` objects.
    """

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of ``mesh_dim_names``; ``KeyError`` naming the valid dims for an unknown one."""
        wanted = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        unknown = [name for name in wanted if name not in (self.mesh_dim_names or ())]
        if unknown:
            hints = {v: k for k, v in LIGHTNING_MESH_DIMS.items()}
            fixes = [f"{name!r} -> {hints[name]!r}" for name in unknown if name in hints]
            raise KeyError(
                f"MoEStrategy's device mesh has no dim {', '.join(map(repr, unknown))}: its dims are "
                f"{self.mesh_dim_names} (Lightning ModelParallelStrategy's names, e.g. "
                f"self.device_mesh['tensor_parallel'] in configure_model)"
                + (f"; use {', '.join(fixes)}." if fixes else ".")
            )
        return super().__getitem__(mesh_dim_names)


def lightning_device_mesh(ctx: ParallelContext) -> DeviceMesh:
    """The dense mesh of ``ctx`` (dims ``pp, dp, cp, tp``) under Lightning's names (module docstring)."""
    dense = ctx.dense_mesh
    names = {v: k for k, v in LIGHTNING_MESH_DIMS.items()}
    mesh = DeviceMesh.from_group(
        [dense.get_group(i) for i in range(dense.ndim)], dense.device_type,
        mesh=dense.mesh, mesh_dim_names=tuple(names[name] for name in dense.mesh_dim_names),
    )
    mesh.__class__ = LightningDeviceMesh  # from_group builds a DeviceMesh; only the error message changes
    return mesh
