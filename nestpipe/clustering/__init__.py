"""Key-centric sample clustering and unique-key extraction (see ``docs/clustering.md``).

``assign`` partitions a batch's samples into balanced micro-batches so that samples sharing keys travel
together (fewer rows per micro-batch All2All); ``redundancy`` measures a partition; ``unique_keys`` gives the
batch's unique keys, inverse indices and per-micro-batch key lists; ``refine`` improves a partition by exact-gain
swaps (optionally keeping the micro-batches' costs balanced); ``combine_keys`` merges several tables' keys into one
id space; ``table_fields`` / ``tables_fields`` build the shard fields of a batch's tables.
"""

from nestpipe.clustering.core import assign, method_names, redundancy, refine, table_fields, tables_fields, unique_keys
from nestpipe.clustering.objective import unique_keys_multi, unique_keys_packed
from nestpipe.clustering.keys import combine_keys

__all__ = ["assign", "combine_keys", "refine", "method_names", "redundancy", "table_fields", "tables_fields", "unique_keys", "unique_keys_multi", "unique_keys_packed"]
