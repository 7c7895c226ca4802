"""The ``[tool.hatch-aoti]`` table: typed settings, their reader, and the docs and JSON schema made
from them. Runs in the build backend and the CLI: never imports torch."""
