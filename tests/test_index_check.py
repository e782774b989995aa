"""model.safetensors.index.json's weight map is checked once per shard file, not once per tensor
(issue 28): the same shard list, and the same error naming the same entry, as the per-tensor check it
replaced (`old_check_index`, verbatim but for its name)."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from reshard.errors import SourceError
from reshard.sources.validate import check_index


def old_check_index(index: object, where: str) -> list[str]:
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        found = type(weight_map).__name__ if isinstance(index, dict) else f"a JSON {type(index).__name__}"
        raise SourceError(
            f"{where}: not a safetensors index (needs an object with a non-empty 'weight_map' object, found {found})",
            "download the checkpoint again",
        )
    files: dict[str, None] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors"):
            raise SourceError(f"{where}: weight_map[{name!r}] is {file!r}, not a .safetensors file name")
        path = PurePosixPath(file)
        if path.is_absolute() or ".." in path.parts:
            raise SourceError(f"{where}: weight_map[{name!r}] = {file!r} points outside the checkpoint folder")
        files.setdefault(file)
    return list(files)


def outcome(check, index):
    try:
        return check(index, "idx")
    except SourceError as e:
        return ("error", str(e))


GOOD = {f"t{i}": f"model-{i % 3 + 1:05d}-of-00003.safetensors" for i in range(30)}
CASES = {
    "good": {"weight_map": GOOD},
    "one shard": {"weight_map": dict.fromkeys(GOOD, "model.safetensors")},
    "bad suffix late": {"weight_map": {**GOOD, "x": "model.bin"}},
    "not a string": {"weight_map": {**GOOD, "x": ["a.safetensors"]}},
    "a number": {"weight_map": {"x": 3, **GOOD}},
    "outside, after good uses": {"weight_map": {**GOOD, "y": "../model-00001-of-00003.safetensors"}},
    "absolute": {"weight_map": {"a": "/etc/x.safetensors", **GOOD}},
    "same bad file twice": {"weight_map": {"a": "../x.safetensors", "b": "../x.safetensors"}},
    "empty": {"weight_map": {}},
    "not an object": {"weight_map": []},
    "a list": [1],
}


@pytest.mark.parametrize("case", CASES)
def test_index_checks_as_before(case):
    assert outcome(check_index, CASES[case]) == outcome(old_check_index, CASES[case])
