"""Point-to-point: send, recv and sendrecv (this module re-exports them).

Each family lives in its own module, with its abstract evaluation, lowering,
JVP, transpose and batching rules side by side:

* ``comm/sendrecv.py``: :func:`sendrecv` (``sendrecv_p``) and the flagged
  exchange of a differentiated message (``flagged_sendrecv_p``); its module
  docstring describes the AD convention and the protocol that every
  differentiated point-to-point message follows;
* ``comm/sendrecv_status.py``: receives that report a :class:`Status`, and the
  wildcards ``ANY_SOURCE``/``ANY_TAG`` (``sendrecv_status_p``,
  ``flagged_status_p``);
* ``comm/send_recv.py``: the blocking :func:`send` and :func:`recv`
  (``send_p``, ``recv_p``), each the other's transpose;
* ``comm/_p2p_common.py``: the argument checks and rule helpers they share.

``distlinalg.comm.p2p`` keeps every name it had, so imports from it keep
working. Code that patches a private helper must patch it in the module that
defines it: a re-export does not see the patch.
"""

from __future__ import annotations

from ._p2p_common import ANY_SOURCE, ANY_TAG
from .send_recv import recv, recv_p, send, send_p
from .sendrecv import flagged_sendrecv_p, sendrecv, sendrecv_p
from .sendrecv_status import Status, flagged_status_p, sendrecv_status_p

__all__ = [
    "ANY_SOURCE", "ANY_TAG", "Status", "recv", "recv_p", "send", "send_p", "sendrecv", "sendrecv_p",
    "sendrecv_status_p", "flagged_sendrecv_p", "flagged_status_p",
]
