"""The worker processes: import the project and torch, export, compile, verify against eager, and
fingerprint the result for the cache. Started by :mod:`hatch_aoti.pipeline.core`, never imported by it."""
