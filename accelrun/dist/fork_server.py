"""Imported by the fork server that ranks are forked from (``dist.launch``), and by nothing else.

A SIGTERM to the whole process group (SLURM's preemption, ``scancel``) reaches the fork server too.
Killed, it would take with it the pipes through which the elastic agent learns its ranks' exit codes:
the agent would read every rank as failed and kill them before they save. So the server ignores
SIGTERM (multiprocessing already makes it ignore SIGINT); it ends when the launcher does. Ranks
forked from it inherit the ignoring until the worker installs its own handlers, first thing
(``dist.worker``, ``dist.stop``).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
