"""jaxres: stateful resources for JAX, starting with hash tables as pytrees.

>>> import jax.numpy as jnp, jaxres as jr
>>> t = jr.OpenAddressingTable.create(capacity=16, key=jnp.int32, value=jnp.float32, default=0.0)
>>> t = t.insert(jnp.array([1, 2]), jnp.array([10.0, 20.0]))
>>> t.find(jnp.array([2, 3])).tolist()
[20.0, 0.0]
"""

from jaxres import keys as keys
from jaxres import saved_model as saved_model
from jaxres._core.policies import LFU as LFU
from jaxres._core.policies import LRFU as LRFU
from jaxres._core.policies import LRU as LRU
from jaxres._core.policies import CustomScore as CustomScore
from jaxres._core.policies import Evicted as Evicted
from jaxres._core.sharding.sharded_table import ShardedTable as ShardedTable
from jaxres._core.storages.registry import OpenAddressingTable as OpenAddressingTable
from jaxres._core.storages.registry import SortedTable as SortedTable
from jaxres._core.table import RowHandles as RowHandles
from jaxres._core.table import Table as Table
from jaxres._errors import KeysLostError as KeysLostError
from jaxres._integrations import nnx as _nnx  # noqa: F401  (registers the NNX checkpoint adapters)
from jaxres._nn import embedding_handles as _embedding_handles  # noqa: F401  (registers the rows' adapters)
from jaxres._nn.catch_up import CatchUpAdam as CatchUpAdam
from jaxres._nn.collection import EmbeddingCollection as EmbeddingCollection
from jaxres._nn.collection import FeatureConfig as FeatureConfig
from jaxres._nn.collection import TableConfig as TableConfig
from jaxres._nn.embedding import DynamicEmbedding as DynamicEmbedding
from jaxres._nn.row_gradients import InferenceModeWarning as InferenceModeWarning
from jaxres._nn.row_gradients import grad as grad
from jaxres._nn.row_gradients import value_and_grad as value_and_grad
from jaxres._shell.donation import TableCopyWarning as TableCopyWarning
from jaxres._shell.initializers import KeyValueInitializer as KeyValueInitializer
from jaxres._shell.initializers import TextFileIndex as TextFileIndex
from jaxres._shell.initializers import TextFileInitializer as TextFileInitializer
from jaxres._shell.lookup_table import LookupTable as LookupTable
from jaxres._shell.mutable_table import MutableHashTable as MutableHashTable
from jaxres._shell.resource import Resource as Resource
from jaxres._shell.resource_manager import ResourceManager as ResourceManager
from jaxres._shell.static_tables import StaticHashTable as StaticHashTable
from jaxres._shell.static_tables import StaticVocabularyTable as StaticVocabularyTable
from jaxres._shell.trackable import AutoTrackable as AutoTrackable
from jaxres._shell.trackable import Trackable as Trackable
from jaxres._tracking.checkpoint import Checkpoint as Checkpoint
from jaxres._tracking.checkpoint_manager import CheckpointManager as CheckpointManager
from jaxres._tracking.inspect import inspect_checkpoint as inspect_checkpoint
from jaxres._tracking.ownership import UnlockedDirectoryWarning as UnlockedDirectoryWarning
from jaxres._tracking.status import LoadStatus as LoadStatus

__all__ = [
  "LFU",
  "LRFU",
  "LRU",
  "AutoTrackable",
  "CatchUpAdam",
  "Checkpoint",
  "CheckpointManager",
  "CustomScore",
  "DynamicEmbedding",
  "EmbeddingCollection",
  "Evicted",
  "FeatureConfig",
  "InferenceModeWarning",
  "KeyValueInitializer",
  "KeysLostError",
  "LoadStatus",
  "LookupTable",
  "MutableHashTable",
  "OpenAddressingTable",
  "Resource",
  "ResourceManager",
  "RowHandles",
  "ShardedTable",
  "SortedTable",
  "StaticHashTable",
  "StaticVocabularyTable",
  "Table",
  "TableConfig",
  "TableCopyWarning",
  "TextFileIndex",
  "TextFileInitializer",
  "Trackable",
  "UnlockedDirectoryWarning",
  "grad",
  "inspect_checkpoint",
  "keys",
  "saved_model",
  "value_and_grad",
]
__version__ = "0.1.0"
