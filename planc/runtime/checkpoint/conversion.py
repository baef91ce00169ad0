"""transformers' checkpoint conversion ops, made to see this rank's shard instead of the whole parameter.

transformers' loader converts each tensor it reads (renames, merges, transposes) with ops that may look at the
model parameter they fill. `Transpose(check_dims=True)` (Qwen3-VL-MoE's experts: hub checkpoints store them
`[E, H, 2I]`, the model `[E, 2I, H]`, and transformers' own saves keep the model's layout) decides by comparing
the tensor read with the parameter's shape. Under planc.load the parameter is a sharded DTensor and the tensor
read is this rank's shard, which never has the global shape: the op would always transpose, and a checkpoint
already in the model's layout would come out transposed. The op here compares with the rank's local shape, which
is what the read tensor has when no transpose is needed. Written here because transformers' own sharded loading
avoids such ops rather than handling them (its conversion_mapping says so for other families).
"""

from __future__ import annotations

import torch


def _shard_aware_transpose_cls():
    from transformers.core_model_loading import Transpose

    class ShardAwareTranspose(Transpose):
        """`Transpose(check_dims=True)` against this rank's local shape of the parameter it fills."""

        @torch.no_grad()
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            from torch.distributed.tensor import DTensor

            param = kwargs["model"].get_parameter(kwargs["full_layer_name"])
            local = param.to_local().shape if isinstance(param, DTensor) else param.shape
            target = self.get_target_pattern(input_dict, source_patterns, target_patterns)
            tensors = next(iter(input_dict.values()))
            tensor = tensors[0] if isinstance(tensors, list) else tensors
            if tensor.shape == local:
                return {target: tensor}
            return {target: torch.transpose(tensor, self.dim0, self.dim1).contiguous()}

        @property
        def reverse_op(self):
            # Saving and export see whole tensors, where transformers' own check is right.
            return Transpose(dim0=self.dim1, dim1=self.dim0, check_dims=self.check_dims)

    return ShardAwareTranspose


def shard_aware(mapping: list) -> list:
    """`mapping` (transformers' WeightRenaming/WeightConverter list) with shape-checking ops that compare against
    this rank's shard; converters without such ops are returned as they are."""
    from transformers.core_model_loading import Transpose, WeightConverter

    cls = None
    out = []
    for transform in mapping:
        ops = getattr(transform, "operations", None) if isinstance(transform, WeightConverter) else None
        if ops and any(type(op) is Transpose and op.check_dims for op in ops):
            cls = cls or _shard_aware_transpose_cls()
            ops = [
                cls(op.dim0, op.dim1, check_dims=True) if type(op) is Transpose and op.check_dims else op for op in ops
            ]
            transform = transform.copy(transform.source_patterns, transform.target_patterns, operations=ops)
        out.append(transform)
    return out


__all__ = ["shard_aware"]
