"""Usage: python make_iteration_line.py /path/to/core_v0.16.1-checkout > iteration_line_core_v0.16.1.txt

Run the real log_string-building statements of core_v0.16.1 training_log (lines 2033-2083)
with sample values; everything else (timers, writers, distributed) is replaced by plain values."""
import datetime as _dt
import sys
import textwrap
import types

import torch

CHECKOUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/mlm/core_v0.16.1"
src = open(CHECKOUT + "/megatron/training/training.py").read().splitlines()
block = src[2032:2083]   # 1-based lines 2033..2083
assert block[0].strip().startswith('log_string = f" [{datetime.now()'), block[0]
assert "number of nan iterations" in block[-1], block[-1]
code = textwrap.dedent("\n".join(block))
class FixedDT:
    def __init__(self, t): self.t = t
    def now(self): return self.t
def run(iteration, ts, elapsed_s, tflops, lr, loss, gnorm, log_throughput=True):
    ns = dict(
        datetime=FixedDT(ts),
        args=types.SimpleNamespace(train_iters=10, consumed_train_samples=iteration * 32,
                                   skipped_train_samples=0, rl_use_sequence_packing=False,
                                   log_throughput=log_throughput, log_timers_to_tensorboard=False,
                                   log_energy=False),
        has_rl_utils=False, rl_utils=None, writer=None, wandb_writer=None, energy_monitor=None,
        iteration=iteration, elapsed_time_per_iteration=elapsed_s, throughput=tflops,
        total_iterations=1, learning_rate=lr, batch_size=32,
        advanced_iters_key='advanced iterations', skipped_iters_key='skipped iterations',
        nan_iters_key='nan iterations',
        total_loss_dict={'lm loss': torch.tensor([loss]), 'advanced iterations': 1,
                         'skipped iterations': 0, 'nan iterations': 0},
        should_reset=False,  # avoids torch.tensor(..., device='cuda'); does not change the text
        loss_scale=1.0, grad_norm=gnorm, num_zeros_in_grad=None, params_norm=None, torch=torch)
    exec(code, ns)
    return ns['log_string']
print(run(1, _dt.datetime(2026, 3, 16, 10, 0, 1, 123456), 2.0503, 310.2, 6.0e-05, 11.953125, 12.345))
print(run(2, _dt.datetime(2026, 3, 16, 10, 0, 2, 234567), 1.0, 455.14, 1.2e-04, 11.0234375, 8.5))
