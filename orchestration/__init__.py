"""Launcher: plans, node transports, pid and log files, start, stop, status, compare."""
