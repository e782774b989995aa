"""`s3://bucket/prefix/` URLs: what they name, and where reshard keeps its own objects beside them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.errors import UnsupportedError
from reshard.names import BUCKET_WORK_SUFFIX

SCHEME = "s3://"
# schemes vLLM's config check lets through but whose sharded loader then finds no files
_OTHER_SCHEMES = ("gs://", "gcs://", "az://", "abfs://", "abfss://", "r2://", "oss://")
# S3's rules for bucket names (3-63 characters, lower case, digits, dots, hyphens)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
MAX_PREFIX = 900  # S3 keys are at most 1024 bytes: room for the longest name reshard writes under a prefix
_RANK_IN_PREFIX = re.compile(r"model-(rank-\d+|pp-\d+-tp-\d+)-part-")  # vLLM's s3_glob: fnmatch of whole keys


@dataclass(frozen=True)
class BucketURL:
    """A folder of objects: `bucket` and `prefix` (ends with "/"; never empty)."""

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"

    def key(self, name: str) -> str:
        """The key of the object `name` (a file name) in this folder."""
        return self.prefix + name

    def name(self, key: str) -> str:
        """What follows the prefix in `key` (may hold "/": an object in a nested folder)."""
        return key[len(self.prefix) :]

    @property
    def work(self) -> str:
        """reshard's own objects for this folder (lock, commit journal), beside the prefix, never
        under it: vLLM lists everything under the prefix."""
        return self.prefix.rstrip("/") + BUCKET_WORK_SUFFIX + "/"

    def parents(self) -> list[BucketURL]:
        """The folders this one lies in, nearest first (not the bucket's root)."""
        parts = self.prefix.rstrip("/").split("/")
        return [BucketURL(self.bucket, "/".join(parts[:i]) + "/") for i in range(len(parts) - 1, 0, -1)]


def is_bucket_url(spec: str) -> bool:
    """`spec` names object storage (any scheme://, so that unsupported ones get a clear error)."""
    return "://" in spec and spec.split("://", 1)[0].isalnum()


def parse_bucket_url(spec: str) -> BucketURL:
    """`s3://bucket/prefix[/]` as a BucketURL; other schemes, a bucket's root and odd keys exit 3."""
    if not spec.startswith(SCHEME):
        scheme = spec.split("://", 1)[0]
        why = (
            "vLLM's runai_streamer_sharded finds no files there"
            if spec.startswith(_OTHER_SCHEMES)
            else "only s3:// is supported"
        )
        raise UnsupportedError(
            f"{spec}: {scheme}:// object storage is not supported ({why})",
            "use an s3:// URL (any S3-compatible store: set AWS_ENDPOINT_URL), or a local folder",
        )
    bucket, _, prefix = spec[len(SCHEME) :].partition("/")
    if not _BUCKET.match(bucket):
        raise UnsupportedError(f"{spec}: {bucket!r} is not a valid S3 bucket name", "give s3://BUCKET/PREFIX/")
    prefix = prefix.strip("/")
    if not prefix:
        raise UnsupportedError(
            f"{spec} is a bucket's root: reshard writes an output under a prefix",
            f"give a prefix, e.g. {SCHEME}{bucket}/MODEL-tp8/",
        )
    parts = prefix.split("/")
    if any(p in ("", ".", "..") for p in parts) or any(ord(c) < 32 for c in prefix):
        raise UnsupportedError(f"{spec}: the prefix holds empty, '.' or '..' parts or control characters")
    if "\\" in prefix:  # stores differ: SeaweedFS keeps a backslash as a slash, and the listing then finds nothing
        raise UnsupportedError(
            f"{spec}: the prefix holds a backslash, which S3-compatible stores treat unalike",
            "use / or another character",
        )
    if len(prefix.encode()) > MAX_PREFIX:
        raise UnsupportedError(
            f"{spec}: the prefix is {len(prefix.encode())} bytes; with reshard's names under it a key would pass "
            "S3's 1024 bytes",
            f"choose a prefix of at most {MAX_PREFIX} bytes",
        )
    if _RANK_IN_PREFIX.search(prefix):
        raise UnsupportedError(
            f"{spec}: the prefix holds a rank file's name, and vLLM matches its rank-file pattern "
            "(`*model-rank-R-part-*.safetensors`) against whole keys: a rank would load every rank's files under it",
            "choose a prefix without `model-rank-N-part-` or `model-pp-N-tp-N-part-` in it",
        )
    return BucketURL(bucket, prefix + "/")
