"""What a save writes beside the rank files (config, tokenizer, generation config, ...): one home, so
that `save` writes them and `verify --against SOURCE` derives them again by the same rule.

config.json is copied as it is unless the plan patches it (skipped MTP layers, GPTQ's quantized
modules, ...) or the checkpoint's own code is left out (its `auto_map` dropped without
--trust-remote-code); then it is written again from the source's config with the patch applied.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from reshard.checkpoint import Checkpoint
from reshard.errors import unreadable_source
from reshard.names import CONFIG, INDEX, MANIFEST, WEIGHT_SUFFIXES, is_rank_file_name
from reshard.plan import Plan
from reshard.sidecopy import copy_side_files
from reshard.sources.local import quant_config_from_file


def side_files(root: Path) -> list[str]:
    """Non-weight files vLLM's example copies next to the rank files: config, tokenizer, generation
    config, ... (not weights, indexes, manifests or hidden files)."""
    out = []
    try:
        entries = sorted(root.iterdir())
    except OSError as e:  # EIO, a stale or disconnected mount
        raise unreadable_source(root, e) from e
    for p in entries:
        if p.name.startswith(".") or p.name in (INDEX, MANIFEST) or p.name.endswith(WEIGHT_SUFFIXES):
            continue
        if is_rank_file_name(p.name):
            continue
        out.append(p.name)
    return out


def copy_files(src: Path, names: Iterable[str], dst: Path) -> None:
    """Copy files (and folders) `names` from `src` into `dst` as regular files, keeping times and
    modes. A symlink leading out of the source (or its Hub cache repo folder) or a special file
    (FIFO, device, socket) raises SourceError (exit 4) naming it (reshard.sidecopy)."""
    copy_side_files(src, list(names), dst)


def write_config(folder: Path, config: dict, patch: dict) -> None:
    """config.json with `patch` applied (to its text_config too, where the model keeps one)."""
    config = {**config, **patch}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], **patch}
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def write_side_files(ckpt: Checkpoint, plan: Plan, folder: Path) -> list[str]:
    """Write into `folder` the side files a save of `ckpt` by `plan` holds; their names (as the
    manifest's `copied` lists them)."""
    assert ckpt.root is not None
    code = plan.remote_code
    copied = [n for n in side_files(ckpt.root) if n not in code.skip_files]
    patched = plan.config_patch or code.drop_config_keys
    plain = [n for n in copied if not (n == CONFIG and patched)]
    copy_files(ckpt.root, plain, folder)
    if len(plain) < len(copied):
        config = {k: v for k, v in ckpt.config.items() if k not in code.drop_config_keys}
        if quant_config_from_file(ckpt.root):  # read from hf_quant_config.json, which is copied as it is
            config.pop("quantization_config", None)
        write_config(folder, config, plan.config_patch)
    return copied
