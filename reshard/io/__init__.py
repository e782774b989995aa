"""The executor's I/O: reading source bytes, writing output files, and the memory and threads between.

- `reader`: `FileReader`, a local checkpoint's `reshard.checkpoint.Reader` (and `AlignedReader`);
- `writer`: the `Sink` protocol, `Written`, and `FileWriter` (staged, hashed, O_DIRECT writes);
- `memory`: reused page-aligned slabs and the budget for fresh arrays (`Memory`, `Lease`);
- `dtypes`: dtype casts and fill bytes;
- `prefetch`: the reader threads; `worker`: the writer threads.
"""

from reshard.io.reader import AlignedReader, FileReader, Prepared
from reshard.io.writer import FileWriter, Sink, Written

__all__ = ["AlignedReader", "FileReader", "FileWriter", "Prepared", "Sink", "Written"]
