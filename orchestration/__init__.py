"""The launcher (cli, runner, cluster), what runs on each node (node), the Megatron-LM engine's
runtime adapter (megatron_lm), the offline importer of its argument files (import_args), and the
analysis of runs.

    cli -> runner -> (cluster, node.wire + node.run_state, megatron_lm, import_args, analysis) -> launch_env, megatron_ext
    node -> megatron_ext only
"""
