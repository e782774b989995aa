"""The commit journal of a bucket output (`prefix.reshard/commit.json`, reshard.store.publish): what a
commit in progress completes and deletes, read back by the next run to finish it, and checked first:
it names only this output's objects (the next run deletes some of them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from reshard.errors import OutputError
from reshard.names import MANIFEST
from reshard.store.upload import OpenUpload
from reshard.store.url import BucketURL


@dataclass
class Journal:
    """A commit in progress (`prefix.reshard/commit.json`): what the next run needs to finish it."""

    run: str
    drop_manifest: bool  # the previous output's manifest is deleted first
    uploads: list[OpenUpload]  # the new output's files, completed (replacing keys)
    remove: list[str]  # the previous output's keys the new one does not replace
    manifest: OpenUpload  # completed last
    manifest_etag: str = ""  # the previous manifest's ETag: only that object is deleted ("": any)


def _not_str(key: object) -> str:
    raise TypeError(f"a key to remove is {type(key).__name__}")


def read_journal(raw: bytes, url: BucketURL, key: str) -> Journal:
    """The journal at `key` of the output `url`; OutputError (exit 5) for anything reshard did not write."""

    def bad(why: str) -> OutputError:
        return OutputError(
            f"s3://{url.bucket}/{key} is not a reshard commit journal ({why}), yet it is where {url}'s goes",
            f"delete it if no reshard run is writing {url}; `reshard verify {url}` then says whether the output "
            "there is whole (else save with --overwrite)",
        )

    try:
        obj = json.loads(raw)
        journal = Journal(
            str(obj["run"]),
            bool(obj.get("drop_manifest")),
            [OpenUpload.from_json(o) for o in obj["uploads"]],
            [k if isinstance(k, str) else _not_str(k) for k in obj["remove"]],
            OpenUpload.from_json(obj["manifest"]),
            str(obj.get("manifest_etag") or ""),
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise bad(f"{type(e).__name__}: {str(e)[:80]}") from None
    keys = [up.key for up in journal.uploads] + journal.remove
    outside = [k for k in keys if not k.startswith(url.prefix)]
    if outside or journal.manifest.key != url.key(MANIFEST):
        raise bad(f"it names {(outside or [journal.manifest.key])[0]!r}, not an object of this output")
    return journal
