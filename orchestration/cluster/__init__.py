"""How the launcher reaches nodes: transports (this machine, ssh, docker exec, srun), the parallel
fan-out of node commands, Slurm."""
