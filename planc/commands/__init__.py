"""Sub-commands of the `planc` CLI. Each module: `add_arguments(parser)` and `run(args) -> int` (exit code)."""
