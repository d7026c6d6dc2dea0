"""What a user watches while a run goes: progress, Ray metrics, TensorBoard curves, quiet logs."""
