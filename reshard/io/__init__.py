"""The executor's I/O: reading source bytes, writing output files, and the memory and threads between.

- `reader`: `FileReader`, a local checkpoint's `reshard.checkpoint.Reader` (and `AlignedReader`);
- `writer`: the `Sink` protocol, `Written`, and `FileWriter` (staged, hashed, O_DIRECT writes);
- `memory`: reused page-aligned slabs and the budget for fresh arrays (`Memory`, `Lease`);
- `dtypes`: dtype casts and fill bytes;
- `prefetch`: the reader threads; `worker`: the writer threads;
- `direct`: O_DIRECT and the page cache.

Each is imported by name (`from reshard.io.reader import FileReader`): this package imports none of
them, so what needs only `direct` (`reshard plan`, through `reshard.folderview`) does not load numpy.
"""
