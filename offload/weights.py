"""Weight offloading (docs/design.md 4.10): :class:`WeightOffloader`.

The implementation lives in ``offload/_weights.py``, whose ``# Note [weight residency]``
says when each weight is on the device and why every wait is safe.
"""

from offload._weights import WeightOffloader

__all__ = ["WeightOffloader"]
