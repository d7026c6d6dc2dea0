"""Where users already watch runs besides run.json and TensorBoard: an MLflow tracking server.

Everything here runs in the run's driver (a sweep's trial included); training workers never
talk to the server. MLflow is imported only when tracking=mlflow.
"""
