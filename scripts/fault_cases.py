"""The fault matrix's chain-of-custody sections (issue 24): source integrity, hostile folders, shared runners.

Each is a list of rows run and checked by scripts/fault_run.py (timeouts, peak memory, planted targets).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from scripts.fault_run import BASE_ENV, Result, Section, case, run

# ---- source integrity (the project's own Hub server) ---------------------------------------------


def hub_env(server, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in BASE_ENV.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT")}
    env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1")
    env.update(RESHARD_HUB_BACKOFF="0.01", RESHARD_HUB_RETRIES="3", **extra)
    return env


def rank_bytes(folder: Path) -> dict[str, bytes]:
    run_id = json.loads((folder / "reshard.json").read_text())["run_id"].encode()
    return {p.name: p.read_bytes().replace(run_id, b"0" * len(run_id)) for p in folder.glob("model-rank-*")}


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def integrity(w: Path, sharded: Path) -> Section:
    from tests.fixtures.hubserver import HubServer

    sec = Section("Source integrity", "a Hub repo served by tests/fixtures/hubserver.py (LFS sha256 as ETag)", w)
    ref = w / "int-ref"
    assert run(["save", str(sharded), str(ref), "--tp", "2"]).code == 0
    hub = HubServer().start()
    repo = "acme/tiny-llama"
    hub.add_repo(repo, sharded)

    def published(out: Path) -> Callable[[Result], str]:
        def check(r: Result) -> str:
            if r.code != 0:
                return "OUT_DIR not created" if not out.exists() else "OUT_DIR exists"
            same = out.is_dir() and rank_bytes(out) == rank_bytes(ref)
            return "rank files equal a local save's" if same else "**rank files differ from a local save's**"

        return check

    def save(name: str, home: Path, out: Path, *more: str, previous: Path | None = None, **env: str) -> Result:
        args = ["save", repo, str(out), "--tp", "2", *more]
        chk = None if previous else published(out)
        return case(
            sec,
            name,
            args,
            source=sharded,
            previous=previous,
            allowed=[home, out],
            env=hub_env(hub, home, **env),
            after=chk,
        )

    try:
        home, good = w / "hf-flip", w / "hub-good"
        assert run(["save", repo, str(good), "--tp", "2"], hub_env(hub, home)).code == 0
        blob = sorted(p for p in (home / "hub").rglob("blobs/*") if len(p.name) == 64)[-1]
        flip(blob, blob.stat().st_size - 1)
        save(
            "cached Hub blob with one flipped byte, `save REPO --overwrite` offline over the good output",
            home,
            good,
            "--overwrite",
            previous=good,
            HF_HUB_OFFLINE="1",
        )
        case(
            sec,
            "then `verify GOOD --against REPO --deep` offline on the earlier good output (the cache still corrupt)",
            ["verify", str(good), "--against", repo, "--deep"],
            source=good,
            allowed=[home],
            env=hub_env(hub, home, HF_HUB_OFFLINE="1"),
        )
        save(
            "then `save REPO --overwrite` online over the good output: the corrupt blob fetched again, checked, "
            "renamed over it",
            home,
            good,
            "--overwrite",
            previous=good,
        )
        for keeps, more in ((False, ()), (True, ()), (True, ("--stream",))):
            hub.swap_after, hub.swap_keeps_etag, hub.cdn_answers = 6, keeps, 0  # headers first, then tensors
            label = "under the old ETag (a lying CDN)" if keeps else "under a new ETag"
            i = len(sec.rows)
            save(
                f"CDN serves other bytes of the same length after 6 answers, {label} {' '.join(more)}".strip(),
                w / f"hf-swap-{i}",
                w / f"swap-out-{i}",
                *more,
            )
        hub.swap_after = None
        size = sum(p.stat().st_size for p in sharded.glob("*.safetensors"))
        hub.drop_after, hub.drops = size // 8, 3
        save("download bodies cut short 3 times (then resumed)", w / "hf-drop", w / "drop-out")
        hub.budget, hub.served = size * 2 // 3, 0
        home = w / "hf-budget"
        save("download that stops for good at 2/3 of the bytes", home, w / "budget-out")
        hub.budget, flipped = None, 0
        for log in (home / "hub").rglob("*.reshard-ranges"):
            partial = log.with_name(log.name.replace("ranges", "partial"))
            held = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
            a, b = max(held, key=lambda r: r[1] - r[0])
            if b - a > 1:
                flip(partial, b - 1)
                flipped += 1
        save(f"then {flipped} kept `.reshard-partial` blob(s) with a flipped byte, resumed", home, w / "budget-out")
        save("then the same save once more (the bad partial is fetched anew)", home, w / "budget-out")
    finally:
        hub.stop()
    local = w / "int-local"
    shutil.copytree(sharded, local)
    sums = w / "SHA256SUMS"
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(local.glob("*.safetensors"))]
    lines[0] = "0" * 64 + lines[0][64:]
    sums.write_text("\n".join(lines) + "\n")
    out = w / "sha-out"
    case(
        sec,
        "`--source-sha256` file with one wrong digest",
        ["save", str(local), str(out), "--tp", "2", "--source-sha256", str(sums)],
        source=local,
        allowed=[out],
        after=published(out),
    )
    return sec


# ---- hostile folders ----------------------------------------------------------------------------------


def edit_manifest(folder: Path, fn: Callable[[dict], None]) -> None:
    m = json.loads((folder / "reshard.json").read_text())
    fn(m)
    (folder / "reshard.json").write_text(json.dumps(m))


def hostile(w: Path, llama: Path) -> Section:
    sec = Section("Hostile folders", "a source or output folder prepared by someone else", w)
    secret = w / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("TOP-SECRET-TOKEN\n")

    def holds_no_secret(out: Path) -> Callable[[Result], str]:
        def check(r: Result) -> str:
            files = [p for p in out.rglob("*") if stat.S_ISREG(p.lstat().st_mode)] if out.exists() else []
            leaked = any(b"TOP-SECRET" in p.read_bytes() for p in files) or "TOP-SECRET" in r.message
            return "**the secret was copied**" if leaked else "secret not copied"

        return check

    src = w / "hs-link"
    shutil.copytree(llama, src)
    os.symlink(secret, src / "special_tokens_map.json")
    out = w / "hs-link-out"
    case(
        sec,
        "side file special_tokens_map.json a symlink to a secret outside the source",
        ["save", str(src), str(out), "--tp", "2"],
        source=src,
        targets=[secret],
        allowed=[out],
        after=holds_no_secret(out),
    )
    src = w / "hs-fifo"
    shutil.copytree(llama, src)
    os.mkfifo(src / "tokenizer.model")
    out = w / "hs-fifo-out"
    case(
        sec,
        "side file tokenizer.model a FIFO (nobody writes it)",
        ["save", str(src), str(out), "--tp", "2"],
        source=src,
        allowed=[out],
    )

    good = w / "hs-good"
    assert run(["save", str(llama), str(good), "--tp", "2"]).code == 0

    def copy(name: str) -> Path:
        d = w / "hs" / name
        d.parent.mkdir(exist_ok=True)
        shutil.copytree(good, d)
        return d

    d = copy("zero")
    (d / "model-rank-1-part-0.safetensors").unlink()
    os.symlink("/dev/zero", d / "model-rank-1-part-0.safetensors")
    case(sec, "rank file a symlink to /dev/zero, `verify`", ["verify", str(d)], source=d)

    d = copy("dotdot")  # …/hs/dotdot/../../etc/hostname is …/etc/hostname: a file planted there
    planted = w / "etc" / "hostname"
    planted.parent.mkdir()
    planted.write_text("planted-host-name\n")
    edit_manifest(
        d, lambda m: m["copied_files"].append({"name": "../../etc/hostname", "size": 18, m["checksum"]: "0" * 64})
    )
    case(
        sec,
        "manifest names a copied file `../../etc/hostname`, `verify`",
        ["verify", str(d)],
        source=d,
        targets=[planted],
        after=lambda r: "content not echoed" if "planted" not in r.message else "**echoed**",
    )
    d = copy("tp")
    edit_manifest(d, lambda m: m["layout"].update(tp=10**9))
    case(sec, "manifest `layout.tp = 10**9`, `verify`", ["verify", str(d)], source=d)
    d = copy("deep")
    (d / "reshard.json").write_text("[" * 200_000 + "]" * 200_000)
    case(sec, "manifest nested 200k deep, `verify`", ["verify", str(d)], source=d)
    return sec


# ---- shared runners -------------------------------------------------------------------------------


def shared(w: Path, llama: Path) -> Section:
    sec = Section("Shared runners", "files another user of the machine can plant beside the output", w)
    victim = w / "victim-lock.txt"
    victim.write_text("precious, owned by someone else\n")
    out = w / "lockout"
    (w / ".lockout.reshard.lock").symlink_to(victim)
    case(
        sec,
        "symlink planted at the lock path `.OUT.reshard.lock` to a file the user cares about",
        ["save", str(llama), str(out), "--tp", "2"],
        source=llama,
        targets=[victim],
        allowed=[out],
        after=lambda r: "OUT_DIR not created" if not out.exists() else "OUT_DIR exists",
    )

    if os.geteuid() == 0:  # a folder of another user that everyone may write, no sticky bit
        open_dir = w / "open-to-all"
        open_dir.mkdir()
        os.chown(open_dir, 65534, 65534)
        open_dir.chmod(0o777)
        case(
            sec,
            "OUT_DIR in a folder of another user that every user may write, without the sticky bit",
            ["save", str(llama), str(open_dir / "out"), "--tp", "2"],
            source=llama,
            after=lambda r: "nothing created in it" if not any(open_dir.iterdir()) else "**files created in it**",
        )

    pieces, held = w / "pieces", w / "pieces-held"
    assert run(["save", str(llama), str(pieces), "--tp", "2", "--ranks", "0"]).code == 0
    assert run(["save", str(llama), str(held), "--tp", "2", "--ranks", "1"]).code == 0
    for p in held.iterdir():
        if not (pieces / p.name).exists():
            shutil.copy2(p, pieces / p.name)
    victim = w / "victim-tmp.txt"
    victim.write_text("keep me\n")
    (pieces / ".reshard.json.tmp").symlink_to(victim)

    def assembled(r: Result) -> str:
        ok = run(["verify", str(pieces)]).code == 0
        return "assembled folder verifies" if ok else "assembled folder does **not** verify"

    case(
        sec,
        "`.reshard.json.tmp` symlink planted in a pieces folder, `assemble`",
        ["assemble", str(pieces)],
        source=llama,
        targets=[victim],
        allowed=[pieces],
        after=assembled,
    )
    return sec
