"""Front ends: one small adapter per build system over the same core (``hatch_aoti.build.pipeline``).

Each reads the same table, hands it to :func:`hatch_aoti.build.pipeline.build`, and puts the
staged loader, artifacts, tag and torch requirement into its build system's wheel.
"""
