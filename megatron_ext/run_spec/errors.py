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


class UserError(ValueError):
    """A user error: the message names the value, the rule and the fix."""
