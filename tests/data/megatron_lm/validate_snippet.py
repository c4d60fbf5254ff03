#!/usr/bin/env python3
"""Run Megatron-LM's own parse_args + validate_args on CPU, without torch.distributed.

Usage:
    python tests/data/megatron_lm/validate_snippet.py CHECKOUT WORLD_SIZE [megatron args ...]
e.g.
    python tests/data/megatron_lm/validate_snippet.py /tmp/mlm/core_v0.16.1 32 \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 \
        --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 32 \
        --train-iters 10 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer \
        --vocab-size 1000 --bf16 --use-distributed-optimizer

Prints "ok" (exit 0) or "error: <Megatron's message>" (exit 1) on stdout.  Everything Megatron
itself prints (the argument dump of validate_args, warnings, argparse usage) goes to stderr.

What it does (the CPU-only recipe):
  * os.environ RANK=0, WORLD_SIZE=<n> (parse_args reads them: args.rank / args.world_size);
    LOCAL_RANK=0.  No torch.distributed init, no GPU: parse_args + validate_args do not need
    either unless an option leads validate_args to torch.cuda (e.g. --moe-grouped-gemm,
    tensor/context parallel > 1, --use-megatron-fsdp; those raise on a CPU-only machine).
  * sys.argv = [prog] + argv, then megatron.training.arguments.parse_args() (ignore_unknown_args
    left False, so an unknown flag is an error) and validate_args(args, {}).
  * Optionally also checks what initialize_megatron would check next (set_global_variables ->
    init_num_microbatches_calculator): global batch size divisible by micro batch size x data
    parallel size.  Set MEGATRON_CHECK_MICROBATCHES=0 to skip.
  * Missing optional third-party modules imported unconditionally by the checkout (e.g. triton
    on a CPU-only torch) get a permissive stub; each stub is reported on stderr.
"""

import contextlib
import importlib
import importlib.machinery
import os
import sys
import traceback
import warnings


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_StubBase,), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return cls

    def __getitem__(cls, item):
        return cls


class _StubBase(metaclass=_StubMeta):
    pass


class _StubModule(type(sys)):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_StubBase,), {})


class _StubFinder:
    roots = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0"
        return mod

    def exec_module(self, module):
        pass


_STUBS = _StubFinder()
sys.meta_path.append(_STUBS)


def _import(modname):
    for _ in range(20):
        try:
            return importlib.import_module(modname)
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            if not missing or missing == "megatron" or missing in _STUBS.roots:
                raise
            print(f"validate_snippet: stubbing missing module {missing!r}", file=sys.stderr)
            _STUBS.roots.add(missing)
            for name in list(sys.modules):
                if name == "megatron" or name.startswith("megatron."):
                    del sys.modules[name]
    raise RuntimeError("too many missing modules")


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    checkout = os.path.abspath(sys.argv[1])
    world_size = int(sys.argv[2])
    margv = sys.argv[3:]

    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["RANK"] = "0"
    os.environ.setdefault("LOCAL_RANK", "0")
    sys.path.insert(0, checkout)
    for name in list(sys.modules):
        if name == "megatron" or name.startswith("megatron."):
            del sys.modules[name]
    warnings.simplefilter("ignore")

    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        megatron = _import("megatron")
        mfile = os.path.abspath(list(megatron.__path__)[0])
        if not mfile.startswith(checkout + os.sep):
            print(f"error: megatron imported from {mfile}, not from {checkout}", file=out)
            return 1
        arguments = _import("megatron.training.arguments")
        sys.argv = ["pretrain_gpt.py"] + margv
        try:
            args = arguments.parse_args()
            arguments.validate_args(args, {})
            if os.environ.get("MEGATRON_CHECK_MICROBATCHES", "1") != "0":
                from megatron.core import num_microbatches_calculator as nmc

                nmc._build_num_microbatches_calculator(
                    args.rank,
                    args.rampup_batch_size,
                    args.global_batch_size,
                    args.micro_batch_size,
                    args.data_parallel_size,
                    args.decrease_batch_size_if_needed,
                )
        except SystemExit as e:  # argparse error (message already on stderr) or explicit exit
            print(f"error: argparse/SystemExit({e.code})", file=out)
            return 1
        except Exception as e:  # AssertionError / ValueError / RuntimeError from Megatron
            traceback.print_exc(file=sys.stderr)
            print(f"error: {type(e).__name__}: {e}", file=out)
            return 1
    print("ok", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
