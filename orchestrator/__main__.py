import os
import sys
import time

STARTED_AT = time.time()

# cluster.keep_alive: a running service takes the command, before anything heavy is imported
# (orchestrator/service/).
from orchestrator.service.client import hand_over  # noqa: E402

if __name__ == "__main__":
    served = hand_over(sys.argv[1:], STARTED_AT)
    if served is not None:
        sys.stdout.flush()
        os._exit(served)

from orchestrator.ray_internals.knobs import AUTO_CONNECT  # noqa: E402

# Never let a Ray call made outside the run's own session (after its shutdown, say) start or
# join some other cluster: Ray's auto-init would connect to whatever /tmp/ray/ray_current_cluster
# names (seen: a Ctrl-C during shutdown joined the test suite's shared head, and every later
# run there failed). Read by Ray when it is first imported.
os.environ.setdefault(AUTO_CONNECT, "0")

from orchestrator.redaction import hide_secrets_in_logs  # noqa: E402

hide_secrets_in_logs()  # every log line of this command, its terminal and its files

from orchestrator.cli import main  # noqa: E402  (after the variable above)

if __name__ == "__main__":
    main(STARTED_AT)
