"""TensorFlow MultiWorkerMirroredStrategy on Ray Train's TensorflowTrainer.

Keras 3 fails under MWMS ("Attempt to convert a value (PerReplica...)"); tf-keras (Keras 2)
works, and must be chosen before tensorflow is first imported, hence this line here.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
