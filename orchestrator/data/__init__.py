"""Datasets as numpy arrays (no framework here) and the order in which rows are seen."""
