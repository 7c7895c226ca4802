"""Front ends: one small adapter per build system over the same core (``hatch_aoti.pipeline.core``).

Each reads the same table, hands it to :func:`hatch_aoti.pipeline.core.build`, and puts the
staged loader, artifacts, tag and torch requirement into its build system's wheel.
"""
