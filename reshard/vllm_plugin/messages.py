"""The messages `--load-format reshard` raises or logs: the first differences, then what to do instead
(a `reshard save` line for this engine, the folder's own serve line, `{"strict": false}`), in one line.
Those it raises are escaped by ReshardLoadError, those it logs here (`printable`), as the CLI's lines are."""

from __future__ import annotations

from pathlib import Path

from reshard.errors import printable
from reshard.manifest import Manifest
from reshard.serve import STORE_SCHEME, plain_line, serve_in
from reshard.vllm_plugin.engine import Engine

SHOWN = 3  # differences named in a message
NOT_STRICT = "--model-loader-extra-config '{\"strict\": false}'"


def _first(problems: list[str]) -> str:
    return "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")


def missing_message(folder: Path | str, engine: Engine, missing: list[str]) -> str:
    """The WARNING a non-strict load logs: how many parameters the folder lacks, the first named."""
    names = ", ".join(missing[:SHOWN]) + (f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else "")
    return printable(
        f"reshard: {folder} ({engine.label}): {len(missing)} parameter(s) of the model are not in the folder, "
        f'left as initialised ({{"strict": false}}): {names}'
    )


def unverified_message(folder: Path | str, engine: Engine) -> str:
    """The WARNING a load of a folder saved with `--checksum none` logs: its contents cannot be verified."""
    return printable(
        f"reshard: {engine.label}: {folder} records no checksums (saved with --checksum none): the files' contents "
        "cannot be verified, only their sizes and headers; re-save with checksums to have them verified"
    )


def save_command(manifest: Manifest, engine: Engine) -> str:
    """The `reshard save` line that makes this folder's source for the engine as it runs."""
    orig, runs = manifest.origin, engine.layout
    where = orig.get("path") or orig.get("repo_id") or manifest.source.get("path") or "SOURCE"
    parts = ["reshard save", str(where), "OUT", f"--tp {runs.tp}"]
    if orig.get("repo_id") and orig.get("revision"):
        parts.append(f"--revision {orig['revision']}")
    if runs.pp > 1:
        parts.append(f"--pp {runs.pp}")
    if runs.ep:
        parts.append("--ep")
    if runs.dtype != manifest.layout.dtype:
        parts.append(f"--dtype {runs.dtype}")
    if runs.moe_backend != "auto":
        parts.append(f"--moe-backend {runs.moe_backend}")
    if manifest.layout.mm_encoder_tp_mode or manifest.layout.language_model_only:
        parts.extend(runs.mm_flags())
    return " ".join(parts)


def serve_as_made(manifest: Manifest, folder: Path | str | None = None) -> str | None:
    """The manifest's serve line for this loader, naming `folder` (a local one: where it lies now, not
    where it was saved); None where the line is not one reshard writes (a folder from elsewhere)."""
    line = manifest.serve_reshard or manifest.serve
    if not line or not plain_line(line):
        return None
    line = line.replace("--load-format sharded_state", "--load-format reshard")
    return serve_in(line, str(folder)) if isinstance(folder, Path) else line


def backend_note(manifest: Manifest, engine: Engine) -> str | None:
    """Why the experts may differ: the folder pins a MoE backend the engine left to "auto"."""
    pinned = manifest.layout.moe_pin
    if pinned and engine.layout.moe_backend != pinned:
        return f"the folder was made for --moe-backend {pinned}, this engine runs {engine.layout.moe_backend}"
    return None


def mismatch_message(folder: Path | str, manifest: Manifest, engine: Engine, problems: list[str]) -> str:
    """One message for a folder made for another engine or model: the first differences, then what to do."""
    head = _first(problems)
    if (note := backend_note(manifest, engine)) and note not in head:
        head += f" ({note})"
    fix = f"make a folder for this engine with `{save_command(manifest, engine)}`"
    made = serve_as_made(manifest, folder)
    if made:
        fix += f", or serve this one as it was made: `{made}`"
    return f"--load-format reshard: {folder} does not fit this engine ({engine.label}): {head}. To fix: {fix}"


def state_message(
    folder: Path | str, manifest: Manifest, engine: Engine, problems: list[str], *, missing_only: bool
) -> str:
    """One message for a model whose parameters are not the folder's tensors, though `engine_problems` found
    no difference of layout. A folder made for the MoE backend the engine asks for (`--moe-backend`, where the
    folder pins none or another) is the fix there; otherwise a `reshard save` for this layout would write the
    same folder, so the fix is in what built the model, or `{"strict": false}` where the folder only lacks some."""
    head = _first(problems)
    if (note := backend_note(manifest, engine)) and note not in head:
        made = serve_as_made(manifest, folder)
        fix = f"serve it with the MoE backend it was made for{f': `{made}`' if made else ''}"
        return (
            f"--load-format reshard: {folder} does not fit this engine ({engine.label}): {head} ({note}). To fix: {fix}"
        )
    asked = engine.layout.moe_backend
    if asked not in ("auto", manifest.layout.moe_pin, manifest.layout.moe_backend):
        fix = f"make a folder for this engine's --moe-backend {asked} with `{save_command(manifest, engine)}`"
    else:
        made_by = f"reshard {manifest.reshard_version or '?'} for vLLM {manifest.vllm_versions or '?'}"
        fix = (
            f"the engine built other parameters than the model this folder was saved from ({made_by}; this is "
            f"vLLM {engine.vllm_version}): check the engine's model options (--hf-overrides, --quantization, a "
            "model folder edited since), or save the original checkpoint again with this reshard"
        )
    if missing_only:
        fix = (
            f"to load it anyway, the {len(problems)} parameter(s) left as initialised (as vLLM's sharded_state "
            f"loader's strict=False and `reshard verify --lax` allow), add {NOT_STRICT}; else {fix}"
        )
    return f"--load-format reshard: {folder} does not fit this engine ({engine.label}): {head}. To fix: {fix}"


def files_message(folder: Path | str, engine: Engine, problems: list[str]) -> str:
    head = _first(problems)
    return f"--load-format reshard: {folder} ({engine.label}): {head}. Nothing was loaded. To fix: {damage_fix(folder)}"


def damage_fix(where: Path | str) -> str:
    """What to do about damaged or missing rank files in a folder, or in a bucket prefix."""
    if str(where).startswith(STORE_SCHEME):
        return f"re-save the output to {where} (`reshard save SOURCE {where} --overwrite`), or restore the objects"
    return f"`reshard verify {where}` tells every damaged file; re-save the folder (or restore the files)"
