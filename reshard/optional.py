"""Dependencies only some commands need: torch (an extra, `reshard[torch]`) for casts between float
dtypes (`--dtype`) and `--device cuda`; plan, verify, same-dtype save and merge never import it."""

from __future__ import annotations

from types import ModuleType

from reshard.errors import UnsupportedError, memory_refused

TORCH_HINT = (
    "pip install 'reshard[torch]' (CPU wheel: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
)


def import_torch(why: str) -> ModuleType:
    """torch, or exit 3 saying how to install it (`why`: what needs it)."""
    try:
        import torch
    except ImportError as e:
        if memory_refused(e):  # installed, but its libraries cannot be mapped under the memory limit: exit 5
            raise
        raise UnsupportedError(f"{why} needs torch, which is not installed here", TORCH_HINT) from e
    return torch
