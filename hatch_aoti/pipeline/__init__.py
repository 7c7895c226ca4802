"""The build backend's side of a build: the pipeline, the worker processes it starts and watches, the
wheel's files and tag. Runs inside hatchling or setuptools: never imports torch."""
