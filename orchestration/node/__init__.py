"""What runs on a node: the node commands (one dispatcher), the supervisor, processes, preflight,
the run_state files and their one vocabulary of states, and why a run failed.

Imports only :mod:`megatron_ext` and itself, never the launcher side (a test checks it). The
launcher imports only the contract, :mod:`orchestration.node.wire` (the plan a node runs, every
node command and every answer), and the run-state readers (:mod:`orchestration.node.run_state`).
"""
