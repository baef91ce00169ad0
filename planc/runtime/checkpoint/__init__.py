"""Checkpoints at real scale: `load` (meta build, sliced safetensors reads), `save` (DCP), `export` (hub layout)."""
