"""Model-aware checks: what the expanded plan does to this model that cannot run or loses work.

One module per concern, each a set of functions over the `Resolver` that report through `c.problems`
with the module path, the plan position and what to write instead: `targets` (model type, sizes,
installable styles, rule targets, tied weights), `shards` (even TP splits, whole heads, the FP8
block grid), `experts` (each experts tensor sharded the way its module runs), `megamoe` (what the
Mega MoE kernel needs), `forwards` (forwards that must take the sharded parameters).
"""
