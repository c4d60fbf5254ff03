"""``python -m orchestration``: the launcher's commands (orchestration/cli/), and the node
commands the launcher sends (``node-*``: orchestration/node/commands.py, which loads nothing of
the launcher side)."""

import sys

from orchestration.node.wire import NODE_COMMANDS

if len(sys.argv) > 1 and sys.argv[1] in NODE_COMMANDS:
    from orchestration.node.commands import main
else:
    from orchestration.cli import main

sys.exit(main())
