"""`vllm serve OUT --load-format reshard`: a strict, verifying loader for reshard folders (issue 13).

Installed with reshard (`pip install reshard[vllm]`); vLLM finds it through the `vllm.general_plugins`
entry point, which calls `register` in every vLLM process. Nothing here imports vLLM until vLLM itself
calls `register`: `checks` (what must match before a byte is read) and `reader` (parallel, verified
reads into the parameters) import no vLLM at all; only `loader` does.
"""

from __future__ import annotations

from reshard.serve import PLUGIN_LOAD_FORMAT as LOAD_FORMAT


def register() -> None:
    """The `vllm.general_plugins` entry point: register the loader under `--load-format reshard`.

    vLLM may call it more than once per process (its plugins must allow that): registering again is
    skipped, so vLLM's "already registered" warning does not appear."""
    from vllm.model_executor import model_loader

    from reshard.vllm_plugin.loader import ReshardModelLoader

    registered = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if registered.get(LOAD_FORMAT) is ReshardModelLoader:
        return
    model_loader.register_model_loader(LOAD_FORMAT)(ReshardModelLoader)
