"""What runs on a node: the node commands (one dispatcher), the supervisor, processes, preflight,
the run_state files and their one vocabulary of states, and why a run failed.

Imports only :mod:`megatron_ext` and itself, never the launcher side (a test checks it): the
launcher sends a :class:`~orchestration.node.node_plan.NodePlan` or a node command's argv, the
node answers with one JSON line (:mod:`orchestration.node.node_plan` is that wire format).
"""
