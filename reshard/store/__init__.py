"""Object storage: an S3-compatible bucket as a destination (and a place to read outputs back from).

`s3://bucket/prefix/` names a folder of objects: the rank files, the copied side files and
`reshard.json` lie directly under the prefix, where vLLM's `--load-format runai_streamer_sharded`
finds them (reshard.names). The endpoint, region and credentials come from the standard AWS
variables and profiles (AWS_ENDPOINT_URL, AWS_PROFILE, AWS_ACCESS_KEY_ID, ...), as boto3 reads them.

- `url`: parsing `s3://` URLs (the one home of the scheme and of reshard's work prefix beside the prefix).
- `client`: the boto3 client, its retries, and turning S3 errors into one-line errors with exit codes.
- `upload`: streaming multipart uploads with per-part SHA256 checksums the store checks, kept open
  until the whole output is uploaded (`ObjectWriter`, a `Sink`).
- `publish`: the lock, the guards for vLLM's listing, and the commit: uploads completed, manifest last.
"""

from reshard.store.url import BucketURL, is_bucket_url, parse_bucket_url

__all__ = ["BucketURL", "is_bucket_url", "parse_bucket_url"]
