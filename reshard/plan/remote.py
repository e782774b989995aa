"""Code shipped with a checkpoint (config.json / tokenizer_config.json `auto_map`): run only when asked.

`--trust-remote-code` copies the checkpoint's `.py` files and puts the flag in the serve line.
Without it, an `auto_map` in config.json is dropped from the copied config (every architecture
reshard writes is native in vLLM, whose config registry also knows e.g. Kimi-K2's `kimi_k2`), the
`.py` files are not copied, and a tokenizer that only loads through its own code (Kimi-K2's
`tokenization_kimi.py`) is refused: vLLM would have to run that code to serve the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reshard.checkpoint import Checkpoint
from reshard.errors import UnsupportedError, unreadable_source
from reshard.names import REMOTE_CODE_SUFFIX, TOKENIZER_CONFIG

AUTO_MAP = "auto_map"


@dataclass(frozen=True)
class RemoteCode:
    """What the plan does with a checkpoint's code: trust it (serve line flag, files copied) or
    drop it (config keys removed, files not copied)."""

    trust: bool = False  # --trust-remote-code in the serve line
    drop_config_keys: tuple[str, ...] = ()  # removed from the copied config.json
    skip_files: tuple[str, ...] = ()  # side files not copied
    note: str | None = None


def code_files(root: Path | None) -> tuple[str, ...]:
    """The checkpoint's own Python files (top level, as transformers imports them)."""
    if root is None:
        return ()
    try:
        return tuple(sorted(p.name for p in root.iterdir() if p.name.endswith(REMOTE_CODE_SUFFIX) and p.is_file()))
    except OSError as e:  # EIO, a stale or disconnected mount
        raise unreadable_source(root, e) from e


def _tokenizer_map(root: Path | None) -> dict:
    if root is None or not (root / TOKENIZER_CONFIG).is_file():
        return {}
    try:
        data = json.loads((root / TOKENIZER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}  # not reshard's to judge; vLLM reads it
    amap = data.get(AUTO_MAP) if isinstance(data, dict) else None
    return amap if isinstance(amap, dict) else {}


def _modules(amap: dict) -> list[str]:
    """The `.py` files an auto_map names (`"tokenization_kimi.TikTokenTokenizer"` -> tokenization_kimi.py)."""
    out = []
    for value in amap.values():
        for ref in value if isinstance(value, list) else [value]:
            if isinstance(ref, str) and "." in ref and "--" not in ref:
                out.append(ref.rsplit(".", 1)[0] + REMOTE_CODE_SUFFIX)
    return sorted(set(out))


def remote_code(ckpt: Checkpoint, arch_name: str, trust: bool) -> RemoteCode:
    """Decide for `save`/`plan`: see the module docstring. Raises UnsupportedError (exit 3) for a
    tokenizer that needs its own code when `trust` is False."""
    config_map = ckpt.config.get(AUTO_MAP)
    files = code_files(ckpt.root)
    tokenizer_map = _tokenizer_map(ckpt.root)
    if trust:
        return RemoteCode(trust=bool(config_map or tokenizer_map or files))
    if tokenizer_map:
        needed = _modules(tokenizer_map) or list(files)
        raise UnsupportedError(
            f"{arch_name}: {TOKENIZER_CONFIG} loads its tokenizer through code shipped with the checkpoint "
            f"({', '.join(needed)}), which vLLM only runs with --trust-remote-code",
            f"pass --trust-remote-code to copy and run {', '.join(needed)}",
        )
    if not (config_map or files):
        return RemoteCode()
    dropped = [f"config.json's auto_map ({', '.join(_modules(config_map))})"] if isinstance(config_map, dict) else []
    if files:
        dropped.append(f"{', '.join(files)} not copied")
    note = (
        f"{'; '.join(dropped)}: vLLM loads {arch_name} natively, without running code from the checkpoint "
        "(pass --trust-remote-code to keep it)"
    )
    return RemoteCode(drop_config_keys=(AUTO_MAP,) if config_map is not None else (), skip_files=files, note=note)
