"""The lean storage: open addressing where the slot is the row.

Its folder holds all of it: the table (:mod:`.table`), the slots' layout and
its hashing (:mod:`.layout`), the finding of keys (:mod:`.probing`), the
placing of new keys by claims (:mod:`.placing`), eviction among a new key's
two buckets (:mod:`.eviction`) and the CPU kernels of its reads
(``kernels.cc``: locate, lookup); its writes run the XLA path everywhere. The registry
(:mod:`jaxres._core.storages.registry`) names it ``"lean"``.
"""

from jaxres._core.storages.lean.table import LeanTable as LeanTable

__all__ = ["LeanTable"]
