"""distlinalg's AD convention made convenient (see docs/ad.md).

``grad`` / ``value_and_grad``: exact gradients of a replicated scalar loss
with replicated and sharded arguments. ``check_grads``: finite-difference
and dot-product checks of any SPMD function's derivatives.
"""

from .check import check_grads
from .grad import grad, value_and_grad

__all__ = ["grad", "value_and_grad", "check_grads"]
