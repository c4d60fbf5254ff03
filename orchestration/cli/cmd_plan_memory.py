"""python -m orchestration plan-memory qwen3_1p7b"""

from megatron_ext.run_spec.errors import EXIT_OK
from orchestration.analysis.memory_plan import (DEFAULT_BUS_BANDWIDTH_GBS, DEFAULT_DEVICE, DEFAULT_HEADROOM, DEVICES,
                                                MemoryRequest, plan_memory_request)
from orchestration.analysis.tables import format_memory_plan
from orchestration.launch_env import LaunchEnv

HELP = "memory and data-parallel traffic per GPU for each ZeRO stage, on paper"


def add_arguments(parser) -> None:
    parser.add_argument("model", help="model preset under params/models (or a YAML path)")
    parser.add_argument("data", nargs="?", help="data set (sequence, micro batch, vocabulary, global batch); optional")
    parser.add_argument("--gpus", type=int, help="data-parallel GPUs in all (default NNODES x NPROC_PER_NODE)")
    parser.add_argument("--nnodes", type=int, help="default NNODES")
    parser.add_argument("--nproc-per-node", type=int, help="default NPROC_PER_NODE")
    parser.add_argument("--device", choices=sorted(DEVICES), help=f"device kind (default {DEFAULT_DEVICE}; cpu = fp32 CPU path)")
    parser.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GB (default $GPU_MEMORY_GB, else the device's)")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="fraction of memory kept free (default 0.1)")
    parser.add_argument("--bus-bandwidth-gbs", type=float, default=DEFAULT_BUS_BANDWIDTH_GBS,
                        help=f"data-parallel bus bandwidth, GB/s (default {DEFAULT_BUS_BANDWIDTH_GBS:g}: 4x8 H100 all-reduce)")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence, at most the model's max_position_embeddings (default the data "
                        "set's, else 4096 or the model's positions where fewer)")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default the data set's, else 1)")
    parser.add_argument("--vocab-size", type=int, help="unpadded vocabulary (default the preset's, else the data set's)")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true", default=None,
                        help="reduce gradients in bf16 (default the data set's training.grad_reduce_in_bf16)")
    parser.add_argument("--json", action="store_true", help="the plan as one JSON object")


def run(args, launch: LaunchEnv) -> int:
    request = MemoryRequest(**{k: getattr(args, k) for k in MemoryRequest.__dataclass_fields__})
    plan = plan_memory_request(request, launch.nnodes, launch.nproc_per_node, launch.gpu_memory_gb_text)
    print(plan.to_json() if args.json else format_memory_plan(plan), flush=True)
    return EXIT_OK
