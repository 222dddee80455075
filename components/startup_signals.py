"""Imported first by train.py, before torch: a stop signal in the seconds of start-up is kept.

Without it, SIGTERM, SIGINT or SIGHUP while the imports run kills the process (exit 128+N, no
line); with it, `components.preemption.StopRequest` takes the signal over and the run ends
before step 1 in one line, exit 0.
"""

from components.preemption import catch_early

catch_early()
