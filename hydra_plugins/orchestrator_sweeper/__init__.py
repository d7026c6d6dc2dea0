"""Hydra finds sweepers in the `hydra_plugins` namespace package; the work is in orchestrator.sweep."""
