"""The copied files of a local folder (config.json, tokenizer, ...) checked before a weight is read.

vLLM built the engine from the folder's config.json before the loader runs: one edited after the save
builds another model than the rank files were made for (other rope settings serve other tokens without
a word; other layer counts fail with a message that blames the layout). So, as `reshard verify` does,
every file the manifest's `copied_files` lists must be a regular file inside the folder (no symlink
followed, no FIFO waited on), of its recorded size and, when checksums are verified, its digest; and no
file the engine or its tokenizer reads (a chat template, a tokenizer file) may lie there unlisted. A bucket
output's local config folder is checked by `remote.BucketWeights.config_problems`.
"""

from __future__ import annotations

import os
from pathlib import Path

from reshard.format import NotRegular, open_inside
from reshard.hashing import NONE, hash_fd
from reshard.manifest import Manifest
from reshard.names import unlisted_side_files


def copied_problems(folder: Path, manifest: Manifest, *, hashed: bool, always: tuple[str, ...] = ()) -> list[str]:
    """How the folder's copied files differ from what the manifest records (the first of each file). Files
    named in `always` (config.json, which built the engine: a few KB) are hashed even when `hashed` is off."""
    out = []
    for r in manifest.copied_files:
        try:
            fd = open_inside(folder, r.name)
        except NotRegular as e:
            out.append(f"{r.name} is {e.strerror}, not a regular file in the folder")
            continue
        except FileNotFoundError:
            out.append(f"{r.name} is missing")
            continue
        except OSError as e:
            out.append(f"{r.name}: cannot read ({e.strerror})")
            continue
        try:
            size = os.fstat(fd).st_size
            if size != r.size:
                out.append(f"{r.name} has {size} bytes, the manifest says {r.size}: changed after the save")
            elif (
                (hashed or r.name in always)
                and manifest.checksum != NONE
                and r.digest
                and hash_fd(fd, manifest.checksum) != r.digest
            ):
                out.append(f"{r.name} changed after the save ({manifest.checksum} differs from the manifest's)")
        except OSError as e:
            out.append(f"{r.name}: cannot read ({e.strerror})")
        finally:
            os.close(fd)
    if manifest.copied_files:  # an output that records what it copied: nothing else is served with it
        try:
            names = os.listdir(folder)
        except OSError as e:
            return [*out, f"cannot list the folder ({e.strerror})"]
        for name in sorted(unlisted_side_files(names, manifest.copied)):
            out.append(f"{name} is not in the manifest (added after the save?): vLLM or its tokenizer reads it")
    return out


def copied_message(folder: Path, problems: list[str], shown: int) -> str:
    head = "; ".join(problems[:shown])
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return (
        f"--load-format reshard: {folder}: {head}{more}. vLLM built this engine from the folder's config.json, "
        "which must be the one saved with the rank files. To fix: restore the files (`reshard verify "
        f"{folder}` names each), or re-save the folder from its source"
    )
