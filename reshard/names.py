"""Every name reshard gives a file or folder, in one place: rank files and their globs, manifests,
staging, old and lock names beside OUT_DIR, Hugging Face checkpoint files.

vLLM's ShardedStateLoader finds a rank's files with a glob of its `pattern` (`model-rank-{rank}-part-*`
or, with pipeline parallelism, `model-pp-{pp}-tp-{tp}-part-*`). Everything that names, matches or
lists such a file goes through here.
"""

from __future__ import annotations

import fnmatch
import glob
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

# ---- rank files (vLLM's sharded_state naming) ---------------------------------------------------

TP_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
RANK_FILE_GLOBS = ("model-rank-*.safetensors", "model-pp-*.safetensors")

_TP_FILE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")
_PP_FILE = re.compile(r"^model-pp-(\d+)-tp-(\d+)-part-(\d+)\.safetensors$")

DEFAULT_MAX_PART = 5 * 1024**3  # bytes per rank file part, as vLLM's save_sharded_state example
# a rank file's safetensors metadata key for its own name (absent from outputs written before it), so
# that a file renamed or swapped with another is told apart without its digest
FILE_NAME_META = "reshard_file"

# ---- reshard's own files -------------------------------------------------------------------------

MANIFEST = "reshard.json"
PIECE_MANIFEST = "reshard.ranks-{tag}.json"  # a `save --ranks` piece's partial manifest
PIECE_MANIFEST_GLOB = "reshard.ranks-*.json"
TMP_PREFIX = ".reshard-tmp-"  # a run's temporary folder inside OUT_DIR (reshard < 0.4; removed when seen)

# ---- beside OUT_DIR: `.<OUT_DIR name><kind><tag>` (reshard.publish) ---------------------------------

STAGING = ".reshard-new-"  # a run's new OUT_DIR, built complete before the swap
OLD = ".reshard-old-"  # the previous OUT_DIR between two renames (no RENAME_EXCHANGE)
LOCK = ".reshard.lock"  # one run per OUT_DIR
HIDDEN_PREFIX = ".reshard"  # anything above, or a temporary file of reshard's inside OUT_DIR

# ---- object storage: `s3://bucket/prefix/` and reshard's objects beside it (reshard.store) ----------

BUCKET_WORK_SUFFIX = ".reshard"  # `prefix.reshard/`: never under the prefix, which vLLM lists whole
BUCKET_LOCK = "lock.json"  # one run per prefix (a conditional create)
BUCKET_JOURNAL = "commit.json"  # the uploads a publish completes; a later run finishes an interrupted one
BUCKET_HANDOVER = "uploads-{rank}.json"  # a torchrun process's open uploads, for process 0 to commit
BUCKET_HANDOVER_GLOB = "uploads-*.json"

# ---- scratch outside OUT_DIR, named after the run that owns it (reshard.scratch) ------------------------

SCRATCH_DIR = "reshard-{kind}.{owner}."  # in the temp folder: a random tail follows (tempfile.mkdtemp)
SCRATCH_DIR_GLOB = "reshard-*.*-*-*.*"

# ---- Hugging Face checkpoints ----------------------------------------------------------------------

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
# ModelOpt <= 0.29's quantization config, which vLLM reads when config.json has no quantization_config
HF_QUANT_CONFIG = "hf_quant_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# code a checkpoint ships for transformers to run (auto_map): copied only with --trust-remote-code
REMOTE_CODE_SUFFIX = ".py"
# files a Hub download needs: weights, config, tokenizer and generation files
# (and the remote code a config.json auto_map names: Kimi-K2's tokenization_kimi.py, configuration_*.py)
HUB_PATTERNS = ("*.safetensors", "*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*", "*.py")
# weight formats that are never copied next to the rank files
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")


@dataclass(frozen=True, slots=True)
class RankFile:
    """What a rank file's name says: its pipeline stage, tensor-parallel rank and part."""

    pp_rank: int
    tp_rank: int
    part: int


def rank_file_name(*, tp_rank: int, pp_rank: int, part: int, pp: int) -> str:
    """The name vLLM's loader looks for: TP_PATTERN, or PP_PATTERN when pp > 1."""
    if pp > 1:
        return PP_PATTERN.format(pp_rank=pp_rank, tp_rank=tp_rank, part=part)
    return TP_PATTERN.format(rank=tp_rank, part=part)


def file_pattern(pp: int) -> str:
    """The pattern recorded in the manifest (and the one vLLM's --load-format sharded_state uses)."""
    return PP_PATTERN if pp > 1 else TP_PATTERN


def parse_rank_file(name: str) -> RankFile | None:
    """The ranks a reshard-named file holds, or None for any other name."""
    m = _TP_FILE.match(name)
    if m:
        return RankFile(0, int(m.group(1)), int(m.group(2)))
    m = _PP_FILE.match(name)
    if m:
        return RankFile(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    return None


def vllm_globs(*, tp: int, pp: int) -> list[str]:
    """The globs vLLM's ShardedStateLoader loads, one per rank (its pattern rendered with part="*"):
    any file they match is loaded by that rank, whatever reshard thinks of it."""
    pattern = file_pattern(pp)
    return [pattern.format(rank=t, tp_rank=t, pp_rank=p, part="*") for p in range(pp) for t in range(tp)]


# what vLLM, transformers' tokenizers and processors read beside the weights (the folder's top level)
ENGINE_READS = ("*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "vocab*", "merges*", "*.py")


def unlisted_side_files(names: Iterable[str], copied: Iterable[str]) -> list[str]:
    """Top-level files the engine or its tokenizer reads (config, tokenizer, chat template, generation
    settings, remote code: what save copies) that an output's manifest does not list (added after the save)."""
    listed = set(copied)
    return [
        n
        for n in names
        if "/" not in n
        and n not in listed
        and n != MANIFEST
        and not n.startswith(HIDDEN_PREFIX)
        and not fnmatch.fnmatch(n, PIECE_MANIFEST_GLOB)
        and any(fnmatch.fnmatch(n, p) for p in ENGINE_READS)
    ]


def unlisted_rank_files(names: Iterable[str], listed: Collection[str], *, tp: int, pp: int) -> list[str]:
    """Of a folder's `names`, the rank files it does not list: named as reshard names them, or
    matched by vLLM's globs (which would load them with their rank), in name order."""
    globs = vllm_globs(tp=tp, pp=pp)
    return sorted(
        n for n in names if n not in listed and (parse_rank_file(n) or any(fnmatch.fnmatchcase(n, g) for g in globs))
    )


def is_rank_file_name(name: str) -> bool:
    """A name vLLM's rank-file glob of some layout matches (what `--overwrite` replaces and copies skip): not
    any name that starts like one (a user's `model-rank-README.md` is kept)."""
    return any(fnmatch.fnmatchcase(name, g) for g in RANK_FILE_GLOBS)


def hf_shard_name(index: int, count: int) -> str:
    """Hugging Face's names for the shards of a checkpoint (`merge`)."""
    return SINGLE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def piece_manifest_name(tag: str) -> str:
    return PIECE_MANIFEST.format(tag=tag)


def rank_files_in(folder: Path) -> list[Path]:
    """Every file in `folder` a rank-file glob matches, sorted."""
    found: set[Path] = set()
    for g in RANK_FILE_GLOBS:
        found.update(folder.glob(g))
    return sorted(found)


def sibling(out_dir: Path, kind: str, tag: str = "") -> Path:
    """`.<name><kind><tag>` beside OUT_DIR (kind: STAGING, OLD or LOCK)."""
    out = out_dir.resolve()
    return out.parent / f".{out.name}{kind}{tag}"


def siblings(out_dir: Path, kind: str) -> list[Path]:
    """Every `.<name><kind>*` beside OUT_DIR, sorted. The name is matched as it is: `m[1]`'s pattern must not
    take `.m1.reshard-new-*`, another output's staging folder (or the only copy of its previous output)."""
    out = out_dir.resolve()
    return sorted(out.parent.glob(f".{glob.escape(out.name)}{kind}*"))
