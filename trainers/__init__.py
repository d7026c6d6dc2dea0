"""Trainers: one training function per framework, on the public worker API
(orchestrator/worker_api.py). Each declares its own config schema and checks where it lives
(``@training_function``); the core finds it through ``trainer.fn`` and never imports this
package.
"""
