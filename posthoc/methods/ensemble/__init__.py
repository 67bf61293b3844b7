"""Ensembles post hoc: mixtures of member methods over several checkpoints, and MultiSWAG on one."""

from posthoc.methods.ensemble import method, multiswag  # noqa: F401
