"""Reads artifacts only: the memory plan on paper, the comparison of runs, its tables and files."""
