"""``python -m jaxcomm.netem --inner SPEC`` (or ``--node SPEC INDEX FD``): the launcher's process
inside the job's namespaces (:func:`jaxcomm.netem._job.main`); start jobs with ``jaxcomm launch``."""

import sys

from ._job import main

sys.exit(main(sys.argv[1:]))
