"""The lean storage: open addressing where the slot is the row.

Its folder holds all of it: the table (:mod:`.table`), the slots' layout and
its hashing (:mod:`.layout`), the finding of keys (:mod:`.probing`) and the
placing of new keys by claims (:mod:`.placing`). It runs on the XLA path
everywhere (no CPU kernels yet). The registry
(:mod:`jaxres._core.storages.registry`) names it ``"lean"``.
"""

from jaxres._core.storages.lean.table import LeanTable as LeanTable

__all__ = ["LeanTable"]
