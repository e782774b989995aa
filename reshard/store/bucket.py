"""A bucket folder's objects: listing (paginated, no delimiter, as vLLM lists), reading, small writes
and deletes, each failure told as one line of the caller's error class."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from reshard.errors import OutputError, ReshardError
from reshard.store.client import error_code, is_missing, is_precondition, make_client, store_error
from reshard.store.url import BucketURL

_DELETE_BATCH = 1000  # S3's limit per DeleteObjects


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str


class Conflict(Exception):
    """A conditional write found the object there already (If-None-Match: *)."""


class Bucket:
    """The objects of one `s3://bucket/prefix/` folder (and of reshard's work prefix beside it)."""

    def __init__(self, url: BucketURL, error: type[ReshardError] = OutputError, client: Any = None) -> None:
        self.url = url
        self.error = error
        self.client = client if client is not None else make_client()

    def fail(self, e: BaseException, doing: str) -> ReshardError:
        return store_error(e, str(self.url), doing, self.error)

    def check_access(self) -> None:
        """The bucket exists and the credentials may list it (one request, fails fast)."""
        try:
            self.client.list_objects_v2(Bucket=self.url.bucket, Prefix=self.url.prefix, MaxKeys=1)
        except Exception as e:
            raise self.fail(e, "listing the prefix") from e

    def list(self, prefix: str | None = None) -> Iterator[ObjectInfo]:
        """Every object under `prefix` (default: the folder's), every page, in key order."""
        prefix = self.url.prefix if prefix is None else prefix
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.url.bucket, Prefix=prefix)
            for page in pages:
                if "IsTruncated" not in page:  # S3 always says; a 200 of another body parses to nothing
                    raise self.error(
                        f"the answer to listing s3://{self.url.bucket}/{prefix} is not an S3 listing",
                        "check AWS_ENDPOINT_URL and any proxy in front of the store; retry later",
                    )
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"], int(obj.get("Size", 0)), str(obj.get("ETag", "")))
        except ReshardError:
            raise
        except Exception as e:
            raise self.fail(e, f"listing {prefix}") from e

    def head(self, key: str) -> dict | None:
        """The object's metadata (with its checksum, where the store keeps one), or None if absent."""
        try:
            return self.client.head_object(Bucket=self.url.bucket, Key=key, ChecksumMode="ENABLED")
        except Exception as e:
            if is_missing(e):
                return None
            raise self.fail(e, f"reading the metadata of {key}") from e

    def get(self, key: str, *, limit: int, start: int = 0, length: int | None = None) -> bytes | None:
        """An object's bytes (or `length` of them from `start`), None if absent; more than `limit`
        bytes raise the folder's error. A body that breaks off before its Content-Length (botocore
        hands a short read over as it is) is asked for again, RESHARD_S3_RETRIES times: a cut
        manifest must not read as a malformed one."""
        import botocore.exceptions as bx

        from reshard import settings

        kwargs: dict[str, Any] = {}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            kwargs["Range"] = f"bytes={start}-{end}"
        retries = settings.S3_RETRIES.get()
        for attempt in range(retries + 1):
            try:
                r = self.client.get_object(Bucket=self.url.bucket, Key=key, **kwargs)
                size = r.get("ContentLength")
                if size is None:  # no length to check against (a chunked answer): read what comes
                    return _read_all(r["Body"], limit)
                if size > limit:
                    r["Body"].close()
                    raise self.error(f"{key}: {size} bytes, more than the {limit} expected")
                try:
                    data = _read_all(r["Body"], size)
                except (bx.ReadTimeoutError, bx.ResponseStreamingError, bx.IncompleteReadError, OSError):
                    data = None
                if data is not None and len(data) == size:
                    return data
                if attempt == retries:
                    cut = bx.ConnectionClosedError(endpoint_url=self.client.meta.endpoint_url)
                    raise self.fail(cut, f"reading {key}, whose body broke off each time")
            except ReshardError:
                raise
            except Exception as e:
                if is_missing(e):
                    return None
                raise self.fail(e, f"reading {key}") from e
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> str:
        """A small object in one request, with its SHA256 for the store to check; its ETag. `create_only`:
        raise Conflict if the key exists."""
        kwargs: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        try:
            r = self.client.put_object(Bucket=self.url.bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256", **kwargs)
        except Exception as e:
            if create_only and is_precondition(e):
                raise Conflict(key) from e
            raise self.fail(e, f"writing {key}") from e
        return str(r.get("ETag", ""))

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete `key` only while it holds the object of `etag` (If-Match), so that a request the network
        delays past the client's timeout, and lands after its retry and what followed it, cannot delete an
        object written since; True when the key is empty now, False when another object is there. A store
        that does not know conditional deletes (NotImplemented) gets a plain delete; one that ignores the
        header deletes as a plain delete would."""
        if not etag:
            self.delete([key])
            return True
        try:
            self.client.delete_object(Bucket=self.url.bucket, Key=key, IfMatch=etag)
        except Exception as e:
            if is_missing(e):  # AWS: If-Match on an absent key
                return True
            if error_code(e) == "NotImplemented":
                self.delete([key])
                return True
            if not is_precondition(e):
                raise self.fail(e, f"deleting {key}") from e
            return self.head(key) is None  # SeaweedFS: 412 for an absent key too
        return True

    def delete(self, keys: list[str]) -> None:
        """Delete `keys` (absent ones are fine)."""
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            try:
                if len(batch) == 1:
                    self.client.delete_object(Bucket=self.url.bucket, Key=batch[0])
                    continue
                r = self.client.delete_objects(
                    Bucket=self.url.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except Exception as e:
                raise self.fail(e, f"deleting {batch[0]}") from e
            errors = [x for x in r.get("Errors", []) if x.get("Code") != "NoSuchKey"]
            if errors:
                raise self.error(f"the object store did not delete {errors[0].get('Key')}: {errors[0].get('Code')}")

    def open_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload open under `prefix`."""
        out: list[tuple[str, str]] = []
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.url.bucket, Prefix=prefix)
            for page in pages:
                out.extend((u["Key"], u["UploadId"]) for u in page.get("Uploads", []) or [])
        except Exception as e:
            raise self.fail(e, f"listing the open uploads under {prefix}") from e
        return out

    def abort(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=key, UploadId=upload_id)
        except Exception as e:
            if not is_missing(e) and "NoSuchUpload" not in str(e):
                raise self.fail(e, f"aborting the open upload of {key}") from e

    def parts(self, key: str, upload_id: str) -> list[dict] | None:
        """The parts of an open upload (for completing it), None if it is no longer open."""
        out: list[dict] = []
        try:
            pages = self.client.get_paginator("list_parts").paginate(
                Bucket=self.url.bucket, Key=key, UploadId=upload_id
            )
            for page in pages:
                for p in page.get("Parts", []) or []:
                    part = {"PartNumber": p["PartNumber"], "ETag": p["ETag"]}
                    if p.get("ChecksumSHA256"):
                        part["ChecksumSHA256"] = p["ChecksumSHA256"]
                    out.append(part)
        except Exception as e:
            if "NoSuchUpload" in str(e) or is_missing(e):
                return None
            raise self.fail(e, f"listing the parts of {key}") from e
        return out


def _read_all(body: Any, size: int) -> bytes:
    """A response body read to its end (at most `size` + 1 bytes, to see a longer one), closed."""
    parts, got = [], 0
    try:
        while got <= size and (chunk := body.read(size + 1 - got)):
            parts.append(chunk)
            got += len(chunk)
    finally:
        body.close()
    return b"".join(parts)
