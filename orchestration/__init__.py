"""The launcher (cli, runner, cluster), what runs on each node (node), and the analysis of runs.

    cli -> runner -> (cluster, node, engines, analysis) -> launch_env, megatron_ext
    node -> megatron_ext only
"""
