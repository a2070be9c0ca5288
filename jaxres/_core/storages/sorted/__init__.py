"""The sorted storage: keys in ascending order, searched by vectorised binary search.

Its folder holds the table (:mod:`.table`, with the read-only form that
serving answers from: :func:`read_only`, :func:`read_only_like`) and its CPU
kernel (``kernels.cc``, compiled into the one library of
``jaxres._core.kernels``). The registry (:mod:`jaxres._core.storages.registry`)
names it ``"sorted"``.
"""

from jaxres._core.storages.sorted.table import SortedTable as SortedTable
from jaxres._core.storages.sorted.table import read_only as read_only
from jaxres._core.storages.sorted.table import read_only_like as read_only_like

__all__ = ["SortedTable", "read_only", "read_only_like"]
