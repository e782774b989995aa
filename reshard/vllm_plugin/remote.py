"""`--load-format reshard` with `{"weights": "s3://bucket/prefix/"}`: the rank files in a bucket; no vLLM, no torch.

vLLM refuses every load format but runai_streamer for an `s3://` model, so the model is a local folder
holding the output's config and tokenizer (`aws s3 cp --recursive --exclude '*.safetensors' ...`), and
the plugin reads the rank files from the bucket, with the local folder's guarantees: the manifest
(`reshard.json`, from the bucket) must fit the engine; the local config must be the one the manifest
records; the prefix is listed (every page) and each of the rank's objects must be there with the
recorded size, a header holding the recorded tensors of the manifest's run, and no stray rank file
beside them; then the objects stream straight into the parameters (`reader`: a ranged GET per stripe,
bounded reads of `PIECE` bytes), every byte checksummed. A connection that drops mid-object resumes
from the byte it reached (RESHARD_S3_RETRIES times); the store's endpoint and credentials come from
the standard AWS environment, as for `reshard save ... s3://`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import struct
from pathlib import Path
from typing import Any

from reshard import settings
from reshard.errors import ReshardError, SourceError
from reshard.format import MAX_HEADER, TensorInfo, parse_header
from reshard.hashing import hash_file
from reshard.manifest import MAX_MANIFEST, FileRecord, Manifest, parse_manifest
from reshard.names import CONFIG, MANIFEST
from reshard.store.bucket import Bucket
from reshard.store.url import parse_bucket_url
from reshard.vllm_plugin import checks, messages
from reshard.vllm_plugin.checks import Engine, RankFile, ReshardLoadError

PIECE = 8 * 1024 * 1024  # bytes per read from a response body: the memory a stream holds beyond the parameters
HEAD = 64 * 1024  # bytes first fetched of a rank object for its header (more when the header is longer)


class BucketWeights:
    """A reshard output in `s3://bucket/prefix/`, read for one rank (and the `striped.Source` it reads from)."""

    def __init__(self, url: str, client: Any = None) -> None:
        self.url = parse_bucket_url(url)
        try:
            self.bucket = Bucket(self.url, error=SourceError, client=client)
        except ReshardError as e:  # boto3 missing
            raise ReshardLoadError(f"--load-format reshard: {e}") from None
        self.retries = settings.S3_RETRIES.get()

    def __str__(self) -> str:
        return str(self.url)

    def _get(self, key: str, *, limit: int, start: int = 0, length: int | None = None) -> bytes | None:
        try:
            return self.bucket.get(key, limit=limit, start=start, length=length)
        except ReshardError as e:
            raise ReshardLoadError(f"--load-format reshard: {e}") from None

    # ---- before a tensor byte is read -------------------------------------------------------------------
    def manifest(self) -> Manifest:
        raw = self._get(self.url.key(MANIFEST), limit=MAX_MANIFEST)
        if raw is None:
            raise ReshardLoadError(
                f"--load-format reshard: {self.url} has no {MANIFEST}: not a complete reshard output. "
                f"To fix: save one there (`reshard save SOURCE {self.url} --tp N`), or correct the "
                '"weights" URL'
            )
        try:
            return parse_manifest(raw, f"{self.url}{MANIFEST}")
        except ReshardError as e:
            raise ReshardLoadError(f"--load-format reshard: {e}") from None

    def config_problems(self, folder: Path, manifest: Manifest) -> list[str]:
        """How the model folder's copies of the output's side files (config, tokenizer) differ from what
        the manifest records: the engine was built from them, so they must be this output's."""
        out = []
        recorded = {r.name: r for r in manifest.copied_files}
        if CONFIG in recorded and not (folder / CONFIG).is_file():
            out.append(f"{CONFIG} is missing")
        for name, r in sorted(recorded.items()):
            path = folder / name
            if not path.is_file():
                continue  # the engine did not read it (a missing tokenizer file fails in vLLM itself)
            try:
                size = path.stat().st_size
                same = size == r.size and (r.digest is None or hash_file(path, manifest.checksum) == r.digest)
            except OSError as e:
                out.append(f"{name}: cannot read ({e.strerror})")
                continue
            if not same:
                out.append(f"{name} differs from the one in {self.url}")
        return out

    def config_message(self, folder: Path, problems: list[str]) -> str:
        head = "; ".join(problems[: messages.SHOWN])
        more = f"; and {len(problems) - messages.SHOWN} more" if len(problems) > messages.SHOWN else ""
        return (
            f"--load-format reshard: {folder} does not hold the config of {self.url}: {head}{more}. To fix: copy "
            f"them from the bucket: `aws s3 cp --recursive --exclude '*.safetensors' {self.url} {folder}`"
        )

    def check_objects(self, manifest: Manifest, entries: list[FileRecord], engine: Engine) -> list[RankFile]:
        """The rank's objects as the manifest lists them, each checked from the listing and its header
        only (as `checks.check_files` checks a folder's files). Raises ReshardLoadError naming every
        problem found (the first few)."""
        try:
            listing = {self.url.name(o.key): o.size for o in self.bucket.list()}
        except ReshardError as e:
            raise ReshardLoadError(f"--load-format reshard: {e}") from None
        problems: list[str] = []
        out: list[RankFile] = []
        if not entries:
            problems.append(f"the manifest lists no file for {engine.label}")
        for e in entries:
            size = listing.get(e.name)
            if size is None:
                problems.append(f"{e.name} is missing")
                continue
            if size != e.size:
                problems.append(f"{e.name} has {size} bytes, the manifest says {e.size}")
                continue
            try:
                infos, meta = self._header(e)
            except SourceError as err:
                problems.append(err.message)
                continue
            problem = checks.header_problem(e, manifest, infos, meta)
            if problem:
                problems.append(problem)
                continue
            out.append(checks.rank_file(Path(e.name), e.size, e, infos))
        glob = checks.rank_glob(engine)
        rank_names = [n for n in listing if "/" not in n and fnmatch.fnmatchcase(n, glob)]
        problems += checks.stray_problems(rank_names, entries)
        if problems:
            raise ReshardLoadError(messages.files_message(self.url, engine, problems))
        return out

    def _header(self, e: FileRecord) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        key, where = self.url.key(e.name), f"{self.url}{e.name}"
        try:
            raw = self.bucket.get(key, limit=HEAD, length=min(HEAD, e.size)) or b""
            if len(raw) < 8:
                raise SourceError(f"{where}: truncated safetensors file ({len(raw)} bytes)")
            (n,) = struct.unpack("<Q", raw[:8])
            if n > e.size - 8 or n > MAX_HEADER:
                raise SourceError(f"{where}: corrupt safetensors header (header length {n}, {e.size} bytes)")
            if 8 + n > len(raw):
                raw += self.bucket.get(key, limit=8 + n, start=len(raw), length=8 + n - len(raw)) or b""
        except SourceError:
            raise
        except ReshardError as err:
            raise SourceError(err.message) from None
        infos, meta, _ = parse_header(raw[8 : 8 + n], e.size, where, e.name)
        return infos, meta

    # ---- reading (striped.Source) -----------------------------------------------------------------------
    def where(self, rf: RankFile) -> str:
        return f"{self.url}{rf.path.name}"

    def open(self, rf: RankFile, start: int = 0, end: int | None = None) -> ObjectStream:
        return ObjectStream(self, rf, start, rf.size if end is None else end)


class ObjectStream(io.RawIOBase):
    """Bytes [start, end) of a rank object: one GET (ranged unless the whole object), read `PIECE`
    bytes at a time; a body that fails mid-way is asked again from the byte reached, `retries` times.
    Failures are OSError (strerror: one line), an object that ends early EOFError."""

    def __init__(self, weights: BucketWeights, rf: RankFile, start: int, end: int) -> None:
        super().__init__()
        self.weights, self.rf = weights, rf
        self.key = weights.url.key(rf.path.name)
        self.name = weights.where(rf)
        self.pos, self.end = start, end
        self.body: Any = None

    def readable(self) -> bool:
        return True

    def _request(self) -> None:
        b = self.weights.bucket
        kwargs = {} if self.pos == 0 and self.end == self.rf.size else {"Range": f"bytes={self.pos}-{self.end - 1}"}
        self.body = b.client.get_object(Bucket=b.url.bucket, Key=self.key, **kwargs)["Body"]

    def _drop(self) -> None:
        body, self.body = self.body, None
        if body is not None:
            with contextlib.suppress(Exception):  # a broken connection: nothing more to do with it
                body.close()

    def readinto(self, view: Any) -> int:
        want = min(len(view), self.end - self.pos, PIECE)
        if want <= 0:
            return 0
        failures = 0
        while True:
            try:
                if self.body is None:
                    self._request()
                data = self.body.read(want)
                if not data:
                    raise EOFError(f"{self.name}: ended at byte {self.pos}, {self.end} expected")
                view[: len(data)] = data
                self.pos += len(data)
                return len(data)
            except EOFError:
                raise
            except Exception as e:  # botocore's and urllib3's failures of a body alike
                self._drop()
                failures += 1
                if _refused(e) or failures > self.weights.retries:
                    raise _os_error(e, self.weights, f"reading {self.rf.path.name}") from e

    def close(self) -> None:
        self._drop()
        super().close()


def _refused(e: BaseException) -> bool:
    """An answer of the store (access denied, no such key, ...): botocore has retried what it retries."""
    return hasattr(e, "response") and isinstance(getattr(e, "response", None), dict)


def _os_error(e: BaseException, weights: BucketWeights, doing: str) -> OSError:
    from reshard.store.client import store_error

    try:
        message = store_error(e, str(weights.url), doing, SourceError).message
    except Exception:  # not botocore's: told as it is
        message = f"{doing}: {type(e).__name__}: {e}"
    err = OSError(message)
    err.strerror = message
    return err
