"""Limits of the Mega MoE kernel that plans are checked against (compiler) and the kernels enforce (kernels)."""

# The real kernel's block alignment beyond its host checks (% 128): H/128 must be even, and at decode-sized
# batches (about <= 8.5 tokens per expert) its heuristics take BLOCK_K = 256 over the intermediate size.
MEGAMOE_KERNEL_BLOCK = 256
