"""The open-addressing storage: buckets of slots with overflow counts, filled by claims.

Its folder holds all of it: the table (:mod:`.table`), the bucket records
(:mod:`.buckets`), the placing of new keys by claims (:mod:`.placing`), the
eviction rounds (:mod:`.eviction_rounds`), and its CPU kernels (``kernels.cc``,
compiled into the one library of ``jaxres._core.kernels``). The registry
(:mod:`jaxres._core.storages.registry`) names it ``"open_addressing"``.
"""

from jaxres._core.storages.open_addressing.table import OpenAddressingTable as OpenAddressingTable

__all__ = ["OpenAddressingTable"]
