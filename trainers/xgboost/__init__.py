"""Distributed XGBoost (rabit collective set up by Ray Train's XGBoostTrainer)."""
