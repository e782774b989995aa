"""The baseline of section 7 (scripts/bench_s3.py): every file of a folder uploaded to a bucket prefix
as `aws s3 cp --recursive` or boto3's upload_file would, with reshard's client, part size and concurrency.

    python -m scripts.s3_upload FOLDER s3://bucket/prefix/

A module of its own, importing only boto3 and reshard's client: the bench's other modules import
numpy, whose OpenBLAS threads then spun on the cores the store needs (5% of the baseline's CPU,
`perf record`), which no real upload pays.
"""

from __future__ import annotations

import sys
from pathlib import Path


def upload_folder(folder: Path, url: str) -> None:
    """Every file of `folder` to `url`: s3transfer's TransferManager, every file submitted at once,
    each part's SHA256 sent for the store to check."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    from reshard import settings
    from reshard.store.client import make_client

    part, conc = settings.S3_PART_SIZE.get(), settings.S3_CONCURRENCY.get()
    config = TransferConfig(
        multipart_threshold=part,
        multipart_chunksize=part,
        max_concurrency=conc,
        preferred_transfer_client="classic",
    )
    bucket, prefix = url[len("s3://") :].split("/", 1)
    with create_transfer_manager(make_client(), config) as manager:
        futures = [
            manager.upload(str(p), bucket, prefix + p.name, extra_args={"ChecksumAlgorithm": "SHA256"})
            for p in sorted(folder.iterdir())
            if p.is_file()
        ]
        for f in futures:
            f.result()


if __name__ == "__main__":
    upload_folder(Path(sys.argv[1]), sys.argv[2])
