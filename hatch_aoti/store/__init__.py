"""The compile cache on disk: content-addressed entries, locks, and directories owned by a live
process. Used by the build backend and the worker alike: never imports torch."""
