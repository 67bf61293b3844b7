"""Machinery the methods share: head finding, the stochastic-suffix runner, random draws, BatchNorm refresh, hooks."""
