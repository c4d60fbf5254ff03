"""Stand-ins for the Adam optimizers megatron-core picks when transformer-engine or apex is
installed (neither is here), keeping their state layout, for tests through the device shim.

    python -m torch.distributed.run --nproc-per-node 2 tests/cuda_on_cpu/worker.py resume --stage 2 --optimizer apex --out DIR

megatron-core's ``megatron/core/optimizer/__init__.py`` imports transformer-engine's FusedAdam,
else apex's, else torch's AdamW, and ``distrib_optimizer.py`` reads the step from where each keeps
it. What matters for checkpoints is copied from their sources, the arithmetic is plain torch:

- apex ``apex.optimizers.FusedAdam``: ``step`` is a per-group integer (``group['step'] += 1``
  before the parameters), ``exp_avg`` / ``exp_avg_sq`` are made per parameter at its first
  gradient and a parameter whose ``grad`` is None is skipped (no state at all); ``adam_w_mode``
  decouples the weight decay.
- transformer-engine ``transformer_engine.pytorch.optimizers.FusedAdam``: the same, the state made
  by ``initialize_state(p)`` (``exp_avg``, ``exp_avg_sq``; ``master_param`` with ``master_weights``).
- torch's AdamW needs no stand-in: a per-parameter ``step`` tensor, the state made at the first
  gradient.

:func:`use` installs one where megatron-core looks (before the optimizer is built).
"""

from __future__ import annotations

import torch


class ApexFusedAdam(torch.optim.Optimizer):
    """apex's FusedAdam's interface and state layout (see the module docstring)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode
        self.master_weights = master_weights

    def initialize_state(self, p: torch.Tensor) -> None:
        self.state[p]["exp_avg"] = torch.zeros_like(p.data)
        self.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            step = group["step"]
            c1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            c2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                grad = p.grad
                if not self.adam_w_mode and group["weight_decay"]:
                    grad = grad + group["weight_decay"] * p
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (state["exp_avg"] / c1) / ((state["exp_avg_sq"] / c2).sqrt() + group["eps"])
                if self.adam_w_mode and group["weight_decay"]:
                    update = update + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])
        return None


class TransformerEngineFusedAdam(ApexFusedAdam):
    """transformer-engine's FusedAdam's state layout: the state made by ``initialize_state``,
    ``master_param`` besides the moments with ``master_weights``."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, adam_w_mode=True, master_weights=False, **_dtype_options):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adam_w_mode, weight_decay=weight_decay, master_weights=master_weights)

    def initialize_state(self, p: torch.Tensor) -> None:
        super().initialize_state(p)
        if self.master_weights:
            self.state[p]["master_param"] = p.detach().clone().float()


STAND_INS = {"apex": ApexFusedAdam, "te": TransformerEngineFusedAdam}


def use(kind: str) -> None:
    """Make megatron-core pick ``kind`` (apex or te) as if it were installed: the class and the
    flags its optimizer modules set at import."""
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer

    mcore_optimizer.Adam = distrib_optimizer.Adam = STAND_INS[kind]  # each module imports its own
    mcore_optimizer.USING_PYTORCH_OPTIMIZER = False
    distrib_optimizer.HAVE_APEX_OR_TE = True
    distrib_optimizer.USING_APEX_OPTIMIZER = kind == "apex"
    distrib_optimizer.USING_TE_OPTIMIZER = kind == "te"

