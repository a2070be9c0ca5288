"""How state is persisted, below the stateful shell and the checkpoints: the core knows nothing of it.

* :mod:`saved_entries`: the arrays a checkpoint holds of a table (the format);
* :mod:`table_arrays`: a functional table as those arrays, and back, through
  the table's public entries in and out;
* :mod:`processes`: what each of several processes holds, and the few
  exchanges between them.
"""
