"""The launcher side: every action a plan (what a dry run prints), then a small step that executes
it and returns a typed result (start, stop, status, submit, sweep). Prints nothing: the CLI does."""
