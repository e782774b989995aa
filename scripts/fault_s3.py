"""The fault matrix's object-storage section (issue 25): `reshard save SRC s3://bucket/prefix/` against a
real S3 server (SeaweedFS, tests/fixtures/s3server.py) and its fault proxy (tests/fixtures/s3faults.py).

Each row is a real `python -m reshard` process (scripts/fault_run.py: timeout, wall, peak RSS), or one
stopped at a moment of its run and signalled (tests/fixtures/s3run.py PAUSE). Afterwards the prefix is
read back as a reader would (tests/fixtures/s3run.py `prefix_state`: the manifest, every object it
lists of its size and digest, nothing else there) and the bucket's open multipart uploads are counted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.fault_run import TIMEOUT, Result, run
from tests.fixtures.s3run import open_uploads, paused, prefix_state, s3_env

TITLE = "Object storage"


class S3Section:
    def __init__(self, server, work: Path) -> None:
        self.server, self.work = server, work
        self.s3 = server.client()
        self.bucket = server.bucket()
        self.rows: list[tuple] = []

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def row(self, name: str, r: Result, prefix: str, journaled: bool = False) -> None:
        state = prefix_state(self.s3, self.bucket, prefix)
        left = len(open_uploads(self.s3, self.bucket))
        msg = r.message.replace("|", "\\|").replace(str(self.work), "…").replace(self.bucket, "BUCKET")
        msg = re.sub(r"127\.0\.0\.1:[0-9]+", "127.0.0.1:PORT", msg)
        seen = state.describe().replace(self.bucket, "BUCKET")
        wall = f"{r.wall:.1f} s / {r.rss_mb:.0f} MB"
        uploads = (
            f"{left} (the journal's, for the next run)" if journaled and left else left if left == 0 else f"**{left}**"
        )
        self.rows.append((name, r.code, msg, seen, uploads, wall))
        print(f"{r.code!s:>4}  {name}: {msg[:90]}  [{seen[:60]}; uploads {left}]", flush=True)

    def case(self, name: str, args: list[str], prefix: str, env: dict | None = None) -> Result:
        r = run(args, env or s3_env(self.server))
        self.row(name, r, prefix)
        return r

    def stopped(self, name: str, args: list[str], prefix: str, at: str, sig: int, journaled: bool = False) -> None:
        """`reshard ARGS` stopped at moment `at`, sent `sig`, let go on (a held signal waits for it)."""
        marker = self.work / f"stopped-{len(self.rows)}"
        t0 = time.monotonic()
        p = paused(args, s3_env(self.server), at=at, marker=marker)
        while not marker.exists() and p.poll() is None and time.monotonic() - t0 < TIMEOUT:
            time.sleep(0.02)
        p.send_signal(sig)
        time.sleep(0.2)
        marker.unlink(missing_ok=True)
        try:
            _, err = p.communicate(timeout=TIMEOUT)
            code: int | str = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            code = "HUNG"
        lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("note: ")]
        said = lines[-1] if lines else f"(killed by signal {-p.returncode})" if isinstance(code, int) else ""
        self.row(name, Result(code, said, time.monotonic() - t0, 0.0), prefix, journaled)


def object_storage(server, w: Path, llama: Path, moe: Path) -> S3Section:
    sec = S3Section(server, w)
    src = str(llama)

    def save(prefix: str, *more: str) -> list[str]:
        return ["save", src, sec.url(prefix), "--tp", "2", *more]

    sec.case("save to an empty prefix", save("out/"), "out/")
    sec.case("the prefix not empty, no --overwrite", save("out/", "--tp", "4"), "out/")
    sec.case(
        "`--overwrite` TP 2 -> TP 4 (no model-rank-2/3 left after going back)",
        save("out/", "--tp", "4", "--overwrite"),
        "out/",
    )
    sec.case("`--overwrite` back to TP 2", save("out/", "--overwrite"), "out/")
    sec.s3.put_object(Bucket=sec.bucket, Key="foreign/old/model-rank-0-part-0.safetensors", Body=b"x")
    sec.case("a copy at `prefix/old/model-rank-0-part-0.safetensors`", save("foreign/", "--overwrite"), "foreign/")
    sec.case("a prefix inside an output (`out/tp4/`)", save("out/tp4/", "--tp", "4"), "out/tp4/")
    assert run(save("nest/tp2/"), s3_env(server)).code == 0
    sec.case("an output below the prefix (`nest/tp2/` holds one, save to `nest/`)", save("nest/"), "nest/")
    for i in range(900):
        sec.s3.put_object(Bucket=sec.bucket, Key=f"many/notes/n-{i:04d}.txt", Body=b"n")
    many = ["save", str(moe), sec.url("many/"), "--tp", "2", "--overwrite"]
    r = sec.case(
        "900 other objects + one file per tensor: over vLLM's 1000 keys", [*many, "--max-part-size", "1"], "many/"
    )
    hint = r.message.split("--max-part-size ")[1].split()[0] if "--max-part-size " in r.message else "1GiB"
    sec.case(f"the same with the hint's `--max-part-size {hint}`", [*many, "--max-part-size", hint], "many/")
    sec.case("gs://", ["save", src, "gs://b/out/", "--tp", "2"], "none/")
    sec.case("a bucket's root", ["save", src, f"s3://{sec.bucket}/", "--tp", "2"], "none/")

    lock = {"host": "builder-7", "pid": 4242, "run": "x", "since": int(time.time())}
    sec.s3.put_object(Bucket=sec.bucket, Key="out.reshard/lock.json", Body=json.dumps(lock).encode())
    sec.case("a lock of another host", save("out/", "--overwrite"), "out/")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.update(host=socket.gethostname(), pid=gone.pid)
    sec.s3.put_object(Bucket=sec.bucket, Key="out.reshard/lock.json", Body=json.dumps(lock).encode())
    sec.case("a dead lock of this host (its pid gone): taken over", save("out/", "--overwrite"), "out/")

    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    bare.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent", PYTHONPATH=str(Path.cwd()))
    sec.case("no credentials (no AWS_* variables, no config files)", save("out/", "--overwrite"), "out/", bare)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = s3_env(server, endpoint=closed, RESHARD_S3_RETRIES="2")
    sec.case("wrong endpoint (a closed port), RESHARD_S3_RETRIES=2", save("out/", "--overwrite"), "out/", env)
    sec.case("missing bucket", ["save", src, "s3://no-such-bucket/out/", "--tp", "2"], "none/")
    sec.case("read-only identity (403)", save("out/", "--overwrite"), "out/", s3_env(server, readonly=True))

    from tests.fixtures.s3faults import S3FaultProxy

    def parts(method: str, path: str, query: str) -> bool:
        return method == "PUT" and "partNumber=" in query

    with S3FaultProxy(server.endpoint) as proxy:
        via = s3_env(server, endpoint=proxy.endpoint)
        proxy.forbidden, proxy.only = 1, parts
        sec.case(
            "403 on a part upload, over the previous output", save("out/", "--tp", "4", "--overwrite"), "out/", via
        )
        proxy.forbidden, proxy.only, proxy.slowdown = 0, None, 2
        sec.case("503 SlowDown twice (retried)", save("out/", "--tp", "4", "--overwrite"), "out/", via)
        proxy.slowdown, proxy.only = 100, parts
        env = {**via, "RESHARD_S3_RETRIES": "2"}
        sec.case(
            "503 SlowDown beyond RESHARD_S3_RETRIES=2, over the previous output",
            save("out/", "--overwrite"),
            "out/",
            env,
        )
        proxy.slowdown, proxy.only, proxy.drop_mid_body = 0, None, 1
        sec.case("connection dropped mid-part (sent again)", save("out/", "--overwrite"), "out/", via)

    over = save("out/", "--tp", "4", "--overwrite")  # the prefix holds a TP 2 output now
    for at, label in (("upload", "while uploading"), ("commit", "just before the commit")):
        sec.stopped(f"Ctrl-C {label}, over the previous output", over, "out/", at, signal.SIGINT)
        sec.stopped(f"SIGTERM {label}, over the previous output", over, "out/", at, signal.SIGTERM)
    sec.stopped("Ctrl-C during the commit (held until it is done)", over, "out/", "completing", signal.SIGINT)
    sec.case("`--overwrite` back to TP 2", save("out/", "--overwrite"), "out/")
    sec.stopped("kill -9 during the commit", over, "out/", "completing", signal.SIGKILL, journaled=True)
    sec.case("then `save` (no --overwrite): finishes the killed run's commit", save("out/"), "out/")
    return sec


def section(w: Path, llama: Path) -> tuple[list[str], bool]:
    """The section's markdown (a SeaweedFS started for it), and whether a row went wrong."""
    from tests.fixtures.s3server import S3Server
    from tests.fixtures.tiny import make_tiny

    moe = make_tiny("qwen3-moe", w / "qwen3-moe")
    with S3Server(w / "s3") as server:
        sec = object_storage(server, w, llama, moe)
    bad = [r for r in sec.rows if r[1] in (1, "HUNG") or "**" in str(r[3]) + str(r[4])]
    return write_section(sec), bool(bad)


def only(out: Path) -> int:
    """`python -m scripts.fault_matrix --only object-storage`: this section alone, spliced into `out`."""
    from tests.fixtures.tiny import make_tiny

    with tempfile.TemporaryDirectory(prefix="reshard-faults-") as tmp:
        w = Path(tmp)
        lines, bad = section(w, make_tiny("llama", w / "llama"))
    splice(out, lines)
    print(f"wrote the {TITLE} section of {out}")
    return 1 if bad else 0


def write_section(sec: S3Section) -> list[str]:
    slowest = max((float(r[5].split()[0]) for r in sec.rows), default=0.0)
    return [
        "",
        f"## {TITLE}",
        "",
        "`reshard save SRC s3://BUCKET/PREFIX/` against SeaweedFS (tests/fixtures/s3server.py) and its fault "
        "proxy (tests/fixtures/s3faults.py), written by scripts/fault_s3.py. After each row the prefix is read "
        "back as a reader would (its manifest, every object it lists of its size and digest, nothing else "
        "there), and the bucket's open multipart uploads are counted (must be 0; a kill -9 during the commit "
        "leaves them, with the journal, for the next run). Rows signalled at a moment stop the run there "
        f"(tests/fixtures/s3run.py PAUSE). Each process ran under a {TIMEOUT:.0f} s timeout; the slowest row "
        f"took {slowest:.1f} s. Peak RSS: the process's own ru_maxrss (0 for the signalled rows).",
        "",
        "| case | exit | message (last line of stderr) | under the prefix afterwards | open uploads | wall / peak RSS |",
        "| --- | --- | --- | --- | --- | --- |",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in sec.rows),
    ]


def splice(doc: Path, lines: list[str]) -> None:
    """Put the section in `doc` in place of an earlier one (else at the end)."""
    text = doc.read_text().rstrip("\n").split("\n")
    head = f"## {TITLE}"
    if head in text:
        start = text.index(head) - 1
        end = next((i for i in range(start + 2, len(text)) if text[i].startswith("## ")), len(text))
        text = text[:start] + lines + (["", *text[end:]] if end < len(text) else [])
    else:
        text += lines
    doc.write_text("\n".join(text) + "\n")
