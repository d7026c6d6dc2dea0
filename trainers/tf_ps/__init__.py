"""TensorFlow ParameterServerStrategy on Ray actors: asynchronous training whose lost worker
does not stop the others (servers.py: the processes; train.py: the coordinator's loop).

tf-keras (Keras 2) must be chosen before tensorflow is first imported, hence these lines here.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
