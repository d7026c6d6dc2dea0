"""Typed configuration: dataclass schemas in Hydra's ConfigStore, checked before Ray starts."""
