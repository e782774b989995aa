"""A Hugging Face checkpoint in a local folder: one `model.safetensors`, or shards with an index."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from reshard.bulk import paused_gc
from reshard.checkpoint import Checkpoint, Reader, Source
from reshard.errors import SourceError, permission_denied, unreadable_source
from reshard.folderview import FolderView
from reshard.format import TensorInfo, kind, open_regular, read_at_most
from reshard.names import CONFIG, HF_QUANT_CONFIG, INDEX, SINGLE
from reshard.sources.headers import read_headers
from reshard.sources.integrity import Expected, Fix, check_files, local_expected
from reshard.sources.validate import check_config, check_index


class LocalSource(Source):
    """A checkpoint folder; its metadata is read once, here (headers only)."""

    def __init__(
        self,
        root: Path,
        ref: dict,
        expected: Expected | None = None,
        sha256_file: Path | None = None,
        fix: Fix | None = None,
    ) -> None:
        """`expected`: each file's sha256 and the check it counts as; None: the local folder's own
        (`reshard.sources.integrity.local_expected`: `sha256_file` (--source-sha256), else
        .cache/huggingface metadata). `fix`: what a file that does not hash to it gets (a Hub
        cache: fetched again online, told how offline); None: exit 4."""
        self.root = root
        self._checkpoint = read_local(root, ref)
        self.expected = expected
        self.sha256_file = sha256_file
        self.fix = fix
        self._seen = {name: self._identity(name) for name in self._checkpoint.files}  # as the headers were read

    def expect(self, more: Expected) -> None:
        """Also check the files of `more` that have no sha256 of their own to be checked against."""
        own = (
            self.expected
            if self.expected is not None
            else local_expected(self.root, self._checkpoint.files, self.sha256_file)
        )
        self.expected = {**more, **own}

    def check(self) -> None:
        """Hash each file that has an expected sha256 (exit 4 on a mismatch); record them all."""
        ckpt = self._checkpoint
        if ckpt.checked:
            return
        expected = self.expected
        if expected is None:
            expected = local_expected(self.root, ckpt.files, self.sha256_file)
        fixed: list[str] = []
        fix = self.fix

        def fix_noted(name: str, got: str, want: str) -> None:
            assert fix is not None
            fix(name, got, want)
            fixed.append(name)  # a checked copy put in its place (a Hub cache): that file, from now on

        ckpt.checked = check_files(self.root, ckpt.files, ckpt.file_sizes, expected, fix and fix_noted)
        for name in fixed:
            self._seen[name] = self._identity(name)

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def open_reader(self) -> Reader:
        from reshard.io.reader import FileReader  # numpy: only when bytes are read, not for planning

        self.check()
        return FileReader(self.root)

    def finish(self) -> None:
        """After the bytes were read, before anything is published: a shard written to since its header was
        read (in place: same size, another download over it) makes the output, and the sha256 the manifest
        records as checked, not what the folder holds. Exit 4."""
        for name, seen in self._seen.items():
            if self._identity(name) != seen:
                raise SourceError(
                    f"{self.root / name} changed while this run read it (written to, or replaced)",
                    "rerun once nothing writes the checkpoint (nothing was published)",
                )

    def _identity(self, name: str) -> tuple[int, ...] | None:
        """The file as the kernel knows it; its change time too, which a write sets and no user can set back
        (an edit in place whose modification time was restored, or one within a coarse mtime's tick)."""
        try:
            st = os.stat(self.root / name)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_local(root: Path, ref: dict) -> Checkpoint:
    """config.json, the index and every shard's header of the checkpoint in `root`. An I/O error of the
    folder itself (EIO, a stale or disconnected mount: listing it, a file's status) is exit 4 too."""
    try:
        return _read_local(root, ref)
    except OSError as e:
        raise unreadable_source(root, e) from e


def _read_local(root: Path, ref: dict) -> Checkpoint:
    config = read_config(root)
    files = weight_files(root)
    tensors: dict[str, TensorInfo] = {}
    sizes: dict[str, int] = {}
    with paused_gc():  # every tensor's record, no cycle among them (reshard.bulk)
        for name, (found, size) in read_headers(root, files):
            sizes[name] = size
            if tensors.keys() & found.keys():
                key = next(k for k in found if k in tensors)
                raise SourceError(
                    f"{root}: tensor {key!r} appears in {tensors[key].file} and {name}",
                    "a shard of another download is mixed in: download the checkpoint again into an empty folder",
                )
            tensors.update(found)
    return Checkpoint(root, config, tensors, files, ref, sizes)


MAX_JSON = 256 * 1024 * 1024  # bytes of a config or index: real ones are a few MB


_REFETCH = "fix the file, or download the checkpoint again"


def read_json(path: Path) -> object:
    """A source's JSON file: regular (a FIFO is refused, not waited on), read up to MAX_JSON bytes
    (a longer one fails to parse). Raises OSError, ValueError, RecursionError."""
    with os.fdopen(open_regular(path), "rb") as f:
        raw = read_at_most(f, MAX_JSON - 1)  # at most MAX_JSON bytes: a longer one fails to parse
    if raw.startswith(b"\xef\xbb\xbf"):  # json.loads of bytes takes it; transformers' reader, as vLLM's, does not
        raise ValueError("it starts with a UTF-8 byte-order mark, which transformers and vLLM cannot read: remove it")
    return json.loads(raw)


def read_config(root: Path | FolderView) -> dict:
    """config.json of a checkpoint or output folder (local, or a bucket folder's view); without a
    quantization_config, that of hf_quant_config.json beside it, as vLLM reads it (ModelOpt <= 0.29)."""
    config = _read_config(root)
    if config.get("quantization_config") is None:
        quant = _read_quant_file(root)
        if quant is not None:
            config = check_config({**config, "quantization_config": quant}, f"{_display(root)}/{HF_QUANT_CONFIG}")
    return config


def quant_config_from_file(root: Path) -> bool:
    """Whether the quantization_config read_config gives for `root` is hf_quant_config.json's (the copied
    config.json must not gain it)."""
    try:
        own = read_json(root / CONFIG)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(own, dict) and own.get("quantization_config") is None and (root / HF_QUANT_CONFIG).is_file()


def _display(root: Path | FolderView) -> str:
    return root.display if isinstance(root, FolderView) else str(root)


def _read_quant_file(root: Path | FolderView) -> dict | None:
    """hf_quant_config.json's object, None when the folder has none."""
    try:
        if isinstance(root, FolderView) and root.local is None:
            quant = json.loads(root.read_small(HF_QUANT_CONFIG, MAX_JSON))
        else:
            local = root.local if isinstance(root, FolderView) else root
            assert isinstance(local, Path)
            quant = read_json(local / HF_QUANT_CONFIG)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise SourceError(*permission_denied(f"{_display(root)}/{HF_QUANT_CONFIG}")) from None
    except (OSError, ValueError, RecursionError) as e:
        raise SourceError(f"{_display(root)}/{HF_QUANT_CONFIG}: cannot parse ({str(e)[:200]})", _REFETCH) from e
    if not isinstance(quant, dict):
        raise SourceError(
            f"{_display(root)}/{HF_QUANT_CONFIG} is a JSON {type(quant).__name__}, not an object",
            "the checkpoint's hf_quant_config.json is damaged: download it again or fix it",
        )
    return quant


def _read_config(root: Path | FolderView) -> dict:
    if isinstance(root, FolderView) and root.local is None:
        try:
            raw = root.read_small(CONFIG, MAX_JSON)
            config = json.loads(raw)
        except FileNotFoundError:
            raise SourceError(f"{root.display}: no {CONFIG}", "the output is incomplete") from None
        except (ValueError, RecursionError) as e:
            raise SourceError(f"{root.where(CONFIG)}: cannot parse ({str(e)[:200]})", _REFETCH) from e
        return check_config(config, root.display)
    root = root.local if isinstance(root, FolderView) and root.local is not None else root
    assert isinstance(root, Path)
    try:
        config = read_json(root / CONFIG)
    except FileNotFoundError:
        raise SourceError(f"{root}: no {CONFIG}", "SOURCE must be a Hugging Face checkpoint folder") from None
    except PermissionError:
        raise SourceError(*permission_denied(root / CONFIG)) from None
    except (OSError, ValueError, RecursionError) as e:
        raise SourceError(f"{root / CONFIG}: cannot parse ({e})", _REFETCH) from e
    return check_config(config, str(root))


def _not_a_file(path: Path) -> str | None:
    """Why `path`, which is no regular file, is there all the same: a symlink leading round in a loop or to
    nothing, a folder, a FIFO, ...; None when nothing is there (a shard missing)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"a symlink to {os.readlink(path)!r}, which does not exist" if path.is_symlink() else None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink that leads round in a loop (to itself, or through others back to it)"
        raise
    return f"not a regular file ({kind(mode)})"


def weight_files(root: Path) -> list[str]:
    """The safetensors files of `root`, in index order (or the single file, or every file)."""
    index = root / INDEX
    if index.exists():
        try:
            files = check_index(read_json(index), str(index))
        except PermissionError:
            raise SourceError(*permission_denied(index)) from None
        except (OSError, ValueError, RecursionError) as e:
            raise SourceError(f"{index}: cannot parse ({e})", "download the checkpoint again") from e
        missing = [f for f in files if not (root / f).is_file()]
        odd = [(f, why) for f in missing if (why := _not_a_file(root / f))]
        if odd:
            raise SourceError(
                f"{root / odd[0][0]}: named in {INDEX} but {odd[0][1]}",
                "replace it with the shard's file, e.g. `hf download REPO`",
            )
        if missing:
            raise SourceError(
                f"{root}: {len(missing)} shard(s) named in {INDEX} are missing: {', '.join(missing[:3])}",
                "download the checkpoint again (e.g. `hf download REPO`)",
            )
        return files
    if (root / SINGLE).is_file():
        return [SINGLE]
    if why := _not_a_file(root / SINGLE):
        raise SourceError(f"{root / SINGLE}: {why}", "replace it with the checkpoint's file, e.g. `hf download REPO`")
    found = sorted(p.name for p in root.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not found:
        hint = "reshard reads safetensors only; convert .bin checkpoints first"
        raise SourceError(f"{root}: no *.safetensors weights found", hint)
    return found
