"""The run specification both programs read: parameters, the ZeRO table, artifact paths, the
resolved parameters file, the iteration record and its log line, FLOPs.

Pure (stdlib + yaml); never imports torch, so the launcher can use it on a login node.
"""
