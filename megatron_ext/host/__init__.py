"""What a process reads and writes on its own machine: another process's identity from /proc, the
GPUs the machine shows, record files written whole. Stdlib only; imported by everything else."""
