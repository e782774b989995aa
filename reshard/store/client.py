"""The S3 client (boto3), and S3's failures told as one line with what to do.

boto3 is the `s3` extra (`pip install 'reshard[s3]'`), imported only when an s3:// URL is used. The
client reads the endpoint, region and credentials the standard way (AWS_ENDPOINT_URL, AWS_REGION,
AWS_PROFILE, AWS_ACCESS_KEY_ID, ...). Each request is retried RESHARD_S3_RETRIES times (throttling such
as 503 SlowDown, 5xx, dropped or refused connections) by botocore's legacy mode, waiting a random share of
1, 2, 4, ... s before each retry (8 retries: up to 255 s, about 2 minutes on average), so that a save
outlasts a store's restart. Not botocore's standard mode: its waits add up to 6 s on average, and one
retry budget per client (about 35 retries) is spent within a second when the store drops every part in
flight at once, failing the next request at its first error whatever RESHARD_S3_RETRIES says. A custom
endpoint (an S3-compatible store) is addressed path-style, as such stores expect.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from reshard import settings
from reshard.errors import ReshardError, UnsupportedError, UsageError, memory_refused

S3_HINT = "pip install 'reshard[s3]'"


def import_boto3() -> ModuleType:
    try:
        import boto3
    except ImportError as e:
        if memory_refused(e):  # installed, but not loadable under the memory limit: exit 5 (reshard.cli)
            raise
        raise UnsupportedError("s3:// needs boto3, which is not installed here", S3_HINT) from e
    return boto3


def endpoint() -> str | None:
    """The custom endpoint the client uses (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL), if any."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def check_endpoint() -> None:
    """A custom endpoint must be an http(s) URL: botocore takes `s3://x` or `ftp://h` and fails each
    request with its own text, which read as a store that could not be reached (exit 4 or 5)."""
    name = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
    url = endpoint()
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"{name} {url!r} is not an http(s) URL", _ENDPOINT_HINT)


_ENDPOINT_HINT = "set it to the store's URL, e.g. http://127.0.0.1:8333"


def path_style() -> bool:
    """Path-style addressing (`endpoint/bucket/key`): for custom endpoints other than AWS's own."""
    url = endpoint()
    return url is not None and "amazonaws.com" not in url


def make_client() -> Any:
    """A thread-safe boto3 S3 client. Checksums are reshard's own (per part, SHA256), so botocore
    computes none of its own; responses are not re-hashed either (reshard hashes what it reads)."""
    boto3 = import_boto3()
    check_endpoint()
    from botocore.config import Config

    config = Config(
        retries={"mode": "legacy", "total_max_attempts": settings.S3_RETRIES.get() + 1},
        connect_timeout=settings.S3_TIMEOUT.get(),
        read_timeout=settings.S3_TIMEOUT.get(),
        max_pool_connections=settings.S3_CONCURRENCY.get() + 4,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # the body is not hashed again for the signature (botocore's default over http; over https it
        # never is): each part's x-amz-checksum-sha256 is signed and the store checks the body against
        # it, and a store that does not confirm it fails the save (reshard.destination)
        s3={"addressing_style": "path" if path_style() else "auto", "payload_signing_enabled": False},
    )
    import botocore.exceptions as bx

    try:
        session = boto3.session.Session()
        region = session.region_name or ("us-east-1" if endpoint() else None)
        return session.client("s3", config=config, region_name=region)
    except bx.ProfileNotFound as e:  # AWS_PROFILE naming a profile the AWS config files lack
        raise UsageError(
            f"AWS_PROFILE: {e}", "set AWS_PROFILE to a profile of ~/.aws/config (or AWS_CONFIG_FILE), or unset it"
        ) from e
    except ValueError as e:  # botocore: "Invalid endpoint: ..."
        raise UsageError(f"AWS_ENDPOINT_URL {endpoint()!r} is not an endpoint URL ({e})", _ENDPOINT_HINT) from e


def error_code(e: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("NoSuchKey", "404", ...), else ""."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def status(e: BaseException) -> int:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_missing(e: BaseException) -> bool:
    return error_code(e) in ("NoSuchKey", "404", "NotFound") or (status(e) == 404 and error_code(e) != "NoSuchBucket")


def is_precondition(e: BaseException) -> bool:
    return error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status(e) in (409, 412)


def store_error(e: BaseException, url: str, doing: str, cls: type[ReshardError]) -> ReshardError:
    """A botocore failure while `doing` (e.g. "uploading model-rank-0-part-0.safetensors") on `url`,
    as one line of class `cls` (OutputError for a destination, SourceError for a source, ...)."""
    import botocore.exceptions as bx

    where = endpoint() or "AWS S3"
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return cls(
            f"no AWS credentials for {url} ({doing})",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, as for the aws CLI",
        )
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        return cls(
            f"cannot reach the object store at {where} ({doing}) after {settings.S3_RETRIES.get()} retries: {e}",
            "check AWS_ENDPOINT_URL and the network; RESHARD_S3_RETRIES allows more",
        )
    if isinstance(e, (bx.ConnectionClosedError, bx.ReadTimeoutError, bx.ConnectionError)):
        retries = settings.S3_RETRIES.get()
        return cls(
            f"the connection to {where} kept failing ({doing}) after {retries} retries: {e}",
            "check the network and rerun; RESHARD_S3_RETRIES / RESHARD_S3_TIMEOUT allow more",
        )
    if isinstance(e, bx.ClientError):
        code, http = error_code(e), status(e)
        bucket = url.split("/")[2] if url.count("/") >= 2 else url
        if code == "NoSuchBucket":
            return cls(f"bucket {bucket} does not exist at {where} ({doing})", f"create it (aws s3 mb s3://{bucket})")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled") or http == 403:
            return cls(
                f"access to {url} denied ({doing}): {code or http}",
                "check the credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID) and that they may list, read, write and "
                "delete objects under the prefix",
            )
        if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded") or http in (429, 503):
            return cls(
                f"the object store kept throttling ({doing}): {code or http} after {settings.S3_RETRIES.get()} retries",
                "rerun later, or lower RESHARD_S3_CONCURRENCY",
            )
        if code in ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"):
            return cls(
                f"the object store received other bytes than reshard sent ({doing}): {code}",
                "a proxy or the network altered the upload; rerun",
            )
        msg = str(e.response.get("Error", {}).get("Message", "")) if hasattr(e, "response") else ""
        return cls(f"the object store refused {doing} on {url}: {code or http} {msg}".rstrip(), "see the store's logs")
    if isinstance(e, bx.BotoCoreError):
        return cls(f"object storage failed ({doing}) on {url}: {e}")
    raise e
