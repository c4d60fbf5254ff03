"""One error type for user errors, and the one place for exit codes.

    raise UserError("ZERO_STAGE='7' is not a ZeRO stage; use 0, 1, 2 or 3")

A :class:`UserError` message names the value, the rule and the fix; entry points print it as one
``error: ...`` line and exit with :data:`EXIT_USER_ERROR`, before anything starts.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_NODE_FAILED = 1
"""A node (or process) failed after the input was accepted."""
EXIT_USER_ERROR = 2
"""Bad input: nothing was started."""
EXIT_PREEMPTED = 3
"""The run saved a checkpoint on request and ended (a preemption, a time limit, stop --save): start
it again to resume."""
EXIT_GAVE_UP = 93
"""The restart breaker ended the run: attempts in a row made no progress. Requeueing it would loop
(NVIDIA's fault-tolerance launcher uses the same code for "do not requeue")."""
EXIT_STOPPED = 130
"""A launcher command waiting on a run was stopped: a sweep (Ctrl-C, SIGTERM, or stop PREFIX), or
``train`` by Ctrl-C."""


class Outcome:
    """A launcher result whose ``ok`` decides its command's exit code: 0, else :data:`EXIT_NODE_FAILED`."""

    ok: bool

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_NODE_FAILED


FINAL = "a restart would meet the same"
"""Said by a failure that no restart can mend (a full disk, no checkpoint that verifies): the
supervisor ends the run instead of restarting it (orchestration/node/attempts.py ``decide``)."""


class UserError(ValueError):
    """A user error: the message names the value, the rule and the fix."""
