"""planc's version: the one definition (the package, the CLI, checkpoint markers and pyproject.toml read it)."""

__version__ = "0.1.0"
