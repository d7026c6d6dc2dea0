"""Distributed LightGBM (data_parallel tree learner, network set up by Ray Train)."""
