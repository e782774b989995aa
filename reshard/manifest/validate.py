"""What a manifest may say: the bounds, and the checks that turn a bad value into a `ManifestProblem`."""

from __future__ import annotations

# bounds on what a manifest may say, far above any real model, so a hostile or damaged one is refused
# before anything sized by it is built (memory stays flat)
MAX_TP = MAX_PP = 4096
MAX_WORLD = 65536
MAX_PART = 10**6
MAX_SIZE = 2**50  # bytes of one file, and of the whole
MAX_FILES = 10**6  # rank files, copied files, source tensors
MAX_TENSORS = 10**7  # tensors over all rank files
MAX_DIMS = 64


class ManifestProblem(ValueError):
    """What makes a manifest unusable, as a phrase (`layout.tp is 0`)."""


def optional(obj: dict, key: str) -> object:
    """A list the manifest may leave out (or null): [] then."""
    v = obj.get(key)
    return [] if v is None else v


def need(ok: bool, problem: str) -> None:
    if not ok:
        raise ManifestProblem(problem)


def as_list(v: object, what: str, most: int = MAX_FILES) -> list:
    need(isinstance(v, list), f"{what} is not a list")
    need(len(v) <= most, f"{what} lists more than {most}")  # type: ignore[arg-type]
    return v  # type: ignore[return-value]


def strings(v: object, what: str) -> list[str]:
    need(isinstance(v, list) and all(isinstance(s, str) for s in v), f"{what} is not a list of names")
    return v  # type: ignore[return-value]


def as_int(v: object, what: str, most: int = MAX_SIZE) -> int:
    need(type(v) is int and 0 <= v <= most, f"{what} is {v!r}")
    return v  # type: ignore[return-value]
