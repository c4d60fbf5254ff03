#!/usr/bin/env python3
"""tests/data/kubernetes/*.schema.json from a CRD file: its one version's openAPIV3Schema, with every
schema's ``description`` dropped and the ``status`` subtree left out (neither validates a manifest).

    git -C jobset show v0.12.0:config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml > jobsets.yaml
    python3 tests/data/kubernetes/extract_schema.py jobsets.yaml > tests/data/kubernetes/jobset.x-k8s.io_v1alpha2_jobset.schema.json
"""
import json
import sys

import yaml


def strip(node, in_props=False):
    if isinstance(node, dict):
        return {k: strip(v, in_props=(k == "properties" and not in_props)) for k, v in node.items()
                if in_props or not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


crd = yaml.safe_load(open(sys.argv[1]))
(version,) = crd["spec"]["versions"]
schema = version["schema"]["openAPIV3Schema"]
schema["properties"].pop("status", None)
sys.stdout.write(json.dumps(strip(schema), indent=1, sort_keys=True) + "\n")
