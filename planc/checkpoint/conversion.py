"""transformers' checkpoint conversion ops, made to see this rank's shard instead of the whole parameter, and to
copy each byte once.

transformers' loader converts each tensor it reads (renames, merges, transposes) with ops that may look at the
model parameter they fill. `Transpose(check_dims=True)` (Qwen3-VL-MoE's experts: hub checkpoints store them
`[E, H, 2I]`, the model `[E, 2I, H]`, and transformers' own saves keep the model's layout) decides by comparing
the tensor read with the parameter's shape. Under planc.load the parameter is a sharded DTensor and the tensor
read is this rank's shard, which never has the global shape: the op would always transpose, and a checkpoint
already in the model's layout would come out transposed. The op here compares with the rank's local shape, which
is what the read tensor has when no transpose is needed. Written here because transformers' own sharded loading
avoids such ops rather than handling them (its conversion_mapping says so for other families).

The per-expert merge of hub checkpoints (`MergeModulelist(dim=0)` then `Concatenate(dim=1)`: Mixtral's w1 and w3
into `gate_up_proj`) stacks each list into a new tensor and then concatenates the stacks into another: every
expert byte is written twice, and the stacks are allocated (page-faulted) only to be freed. The pair here writes
each expert's tensors once, straight into their place in the fused tensor (bit-identical: both are copies); it is
what makes planc.load's fill faster than transformers' own (docs/benchmarks.md, "Sharded loading"). The reverse
ops (save, export) are transformers' own, inherited.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def _shard_aware_transpose_cls() -> type[Any]:
    from transformers.core_model_loading import Transpose

    class ShardAwareTranspose(Transpose):
        """`Transpose(check_dims=True)` against this rank's local shape of the parameter it fills."""

        @torch.no_grad()
        def convert(  # type: ignore[override]  # transformers' base is typed through torch.no_grad
            self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
        ) -> dict[str, Any]:
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
        def reverse_op(self) -> Any:
            # Saving and export see whole tensors, where transformers' own check is right.
            return Transpose(dim0=self.dim1, dim1=self.dim0, check_dims=self.check_dims)

    return ShardAwareTranspose


def _single_copy_merge_classes() -> tuple[type[Any], type[Any]]:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    class ListsThrough(MergeModulelist):
        """`MergeModulelist(dim=0)` followed by `StackedConcatenate`: the lists go on unstacked (the next op writes
        them once into the fused tensor); the reverse stays `SplitModulelist`."""

        def convert(  # type: ignore[override]  # transformers' base is typed through torch.no_grad
            self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
        ) -> dict[str, Any]:
            n = len(input_dict)
            return {self.get_target_pattern(n, k, target_patterns): input_dict.pop(k) for k in list(input_dict)}

    class StackedConcatenate(Concatenate):
        """`torch.cat([torch.stack(list) for list in sources], dim)` with one allocation and one copy per tensor."""

        @torch.no_grad()
        def convert(  # type: ignore[override]  # transformers' base is typed through torch.no_grad
            self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
        ) -> dict[str, Any]:
            target = self.get_target_pattern(target_patterns)
            groups = [input_dict.pop(p) for p in source_patterns if p in input_dict]
            stacks = [g if isinstance(g, torch.Tensor) else None for g in groups]
            if not self._fusable(groups, stacks):  # what transformers' pair does, with its own errors
                return {target: torch.cat([g if s is not None else torch.stack(g) for g, s in zip(groups, stacks)],
                                          dim=self.dim)}
            heads = [g[0] if s is None else s[0] for g, s in zip(groups, stacks)]
            d = self.dim - 1  # the concatenated dim of one expert's tensor
            shape = list(heads[0].shape)
            shape[d] = sum(h.shape[d] for h in heads)
            out = torch.empty((len(groups[0]), *shape), dtype=heads[0].dtype, device=heads[0].device)
            offset = 0
            for group, stack, head in zip(groups, stacks, heads):
                part = out.narrow(self.dim, offset, head.shape[d])
                if stack is not None:
                    part.copy_(stack)
                else:
                    for e, tensor in enumerate(group):
                        part[e].copy_(tensor)
                offset += head.shape[d]
            return {target: out}

        def _fusable(self, groups: list[Any], stacks: list[Optional[torch.Tensor]]) -> bool:
            """Equal expert counts, one dtype and device, shapes equal but for the concatenated dim."""
            if self.dim < 1 or not groups or any(len(g) == 0 for g in groups):
                return False
            d = self.dim - 1
            heads = [g[0] if s is None else s[0] for g, s in zip(groups, stacks)]
            others = [h.shape[:d] + h.shape[d + 1:] for h in heads]
            return (
                len({len(g) for g in groups}) == 1
                and all(h.dtype == heads[0].dtype and h.device == heads[0].device for h in heads)
                and all(h.dim() == heads[0].dim() and o == others[0] for h, o in zip(heads, others))
                and all(s is not None or all(t.shape == g[0].shape for t in g) for g, s in zip(groups, stacks))
            )

    return ListsThrough, StackedConcatenate


def shard_aware(mapping: list[Any]) -> list[Any]:
    """`mapping` (transformers' WeightRenaming/WeightConverter list) with shape-checking ops that compare against
    this rank's shard, and each merge-then-concatenate pair writing once; other converters are returned as they
    are."""
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        Transpose,
        WeightConverter,
    )

    transpose_cls = merge_classes = None
    out = []
    for transform in mapping:
        ops = getattr(transform, "operations", None) if isinstance(transform, WeightConverter) else None
        if not ops:
            out.append(transform)
            continue
        new: list[Any] = []
        for op in ops:
            if type(op) is Transpose and op.check_dims:
                transpose_cls = transpose_cls or _shard_aware_transpose_cls()
                op = transpose_cls(op.dim0, op.dim1, check_dims=True)
            elif (type(op) is Concatenate and op.dim >= 1 and new and type(new[-1]) is MergeModulelist
                  and new[-1].dim == 0):
                merge_classes = merge_classes or _single_copy_merge_classes()
                new[-1] = merge_classes[0](dim=0)
                op = merge_classes[1](op.dim, op.num_shards_attribute)
            new.append(op)
        if any(a is not b for a, b in zip(new, ops)):
            transform = transform.copy(transform.source_patterns, transform.target_patterns, operations=new)
        out.append(transform)
    return out


__all__ = ["shard_aware"]
