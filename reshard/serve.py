"""The `vllm serve` lines that load an output as written, and the load format of reshard's own loader."""

from __future__ import annotations

import json
import os
import re
import shlex

from reshard.layout import Layout

# the --load-format of reshard's vLLM loader plugin (reshard.vllm_plugin): strict and checksum-verified
PLUGIN_LOAD_FORMAT = "reshard"
PLUGIN_NOTE = (
    "or `--load-format reshard` (reshard's vLLM plugin, installed with reshard): it checks the folder against "
    "the engine before reading and verifies every checksum while loading"
)


# vLLM's load format for pre-sharded outputs in object storage (the same ShardedStateLoader, reading
# with the Run:ai streamer); vLLM refuses every other format, reshard's included, for an s3:// model
RUNAI_LOAD_FORMAT = "runai_streamer_sharded"
STORE_SCHEME = "s3://"
# where `--load-format reshard` takes an s3:// output's weights from (the model: a local copy of its
# config and tokenizer files)
PLUGIN_WEIGHTS_KEY = "weights"


_ENV = re.compile(r"[A-Z][A-Z0-9_]*=")  # a serve flag that is an environment setting


def store_env() -> list[str]:
    """The environment the Run:ai streamer needs to read what reshard wrote: the custom endpoint
    (path-style addressing, as reshard used) and region, never credentials."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    env = []
    if url:
        env.append(f"AWS_ENDPOINT_URL={shlex.quote(url)}")
        if "amazonaws.com" not in url:
            env.append("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        env.append(f"AWS_REGION={shlex.quote(region)}")
    return env


def serve_command(
    out_dir: str,
    layout: Layout,
    *,
    load_format: str = "sharded_state",
    extra: tuple[str, ...] = (),
    trust_remote_code: bool = False,
) -> str:
    """The `vllm serve` line that loads `out_dir` as written: the planned `layout` (its dtype, and the
    MoE backend pinned where the experts' layout depends on it); trust_remote_code: the checkpoint
    ships its own config/tokenizer code and `save --trust-remote-code` was asked (Kimi-K2's tokenizer).
    The folder is shell-quoted: the line pastes into a shell as it is, spaces and all.

    An s3:// output is served by vLLM's runai_streamer_sharded, with the endpoint reshard wrote to;
    reshard's plugin cannot take an s3:// model (vLLM refuses it), so its line copies the small files
    to a local folder and names the bucket as the plugin's `weights`."""
    if out_dir.startswith(STORE_SCHEME):
        return _store_command(out_dir, layout, load_format, extra, trust_remote_code)
    # e.g. VLLM_USE_V2_MODEL_RUNNER=0, VLLM_PP_LAYER_PARTITION=1,3: before the command
    env = [*layout.serve_env(), *(e for e in extra if _ENV.match(e))]
    extra = tuple(e for e in extra if e not in env)
    parts = [
        *env,
        f"vllm serve {shlex.quote(out_dir)} --load-format {load_format}",
        f"--tensor-parallel-size {layout.tp}",
    ]
    if layout.pp > 1:
        parts.append(f"--pipeline-parallel-size {layout.pp}")
    if layout.ep:
        parts.append("--enable-expert-parallel")
    parts.append(f"--dtype {layout.dtype}")
    if layout.moe_pin:
        parts.append(f"--moe-backend {layout.moe_pin}")
    parts.extend(extra)  # e.g. --language-model-only: the files hold no vision tower
    if trust_remote_code:
        parts.append("--trust-remote-code")
    return " ".join(parts)


def _store_command(url: str, layout: Layout, load_format: str, extra: tuple[str, ...], trust: bool) -> str:
    env = " ".join(store_env())
    env = env + " " if env else ""
    if load_format != PLUGIN_LOAD_FORMAT:
        return env + serve_command(
            "@", layout, load_format=RUNAI_LOAD_FORMAT, extra=extra, trust_remote_code=trust
        ).replace("vllm serve @", f"vllm serve {shlex.quote(url)}", 1)
    local = url[len(STORE_SCHEME) :].rstrip("/").rsplit("/", 1)[-1] + "-config"
    weights = json.dumps({PLUGIN_WEIGHTS_KEY: url})
    line = serve_command(local, layout, load_format=PLUGIN_LOAD_FORMAT, extra=extra, trust_remote_code=trust)
    pull = f"aws s3 cp --recursive --exclude '*.safetensors' {shlex.quote(url)} {shlex.quote(local)}"
    return f"{pull} && {env}{line} --model-loader-extra-config {shlex.quote(weights)}"


_SERVE = "vllm serve "
_LOAD_FORMAT = " --load-format "


def serve_in(line: str, folder: str) -> str:
    """A local folder's serve `line` (environment settings before it included) naming `folder`
    instead of the one it was written for: the folder a piece was saved to, once assembled, or the
    path `verify` was given (a folder moved since its save). Bucket lines name their bucket: as is."""
    at = line.find(_SERVE)
    end = line.find(_LOAD_FORMAT, at + len(_SERVE)) if at >= 0 else -1
    if at < 0 or end < 0 or STORE_SCHEME in line or (at and not _ENV.match(line)):
        return line
    return f"{line[: at + len(_SERVE)]}{shlex.quote(folder)}{line[end:]}"


_BARE = re.compile(r"[\w@%+=:,./ -]")  # what a shell takes literally outside quotes (shlex.quote's safe set)


def _inert(text: str) -> bool:
    """Does a shell read `text` as plain words only: outside quotes nothing but `_BARE`, inside
    single quotes anything but a line break, inside double quotes nothing it expands ($, `, \\).
    shlex.quote's quoting passes (a path holding `'`, `$` or a backtick); `x; rm -rf ~` does not."""
    state = ""  # "", "'" or '"'
    for ch in text:
        if ch in "\n\r":
            return False
        if state == "'":
            state = "" if ch == "'" else state
        elif state == '"':
            if ch in "$`\\":
                return False
            state = "" if ch == '"' else state
        elif ch in "'\"":
            state = ch
        elif not _BARE.match(ch):
            return False
    return state == ""


def plain_line(line: object) -> bool:
    """Could `line` be a serve line reshard wrote: text starting with `vllm serve` (after environment
    settings) or a bucket's `aws s3 cp ... && ...`, with nothing else a shell would act on (a folder
    from elsewhere may hold `vllm serve x; rm -rf ~`: verify does not repeat such a line; a path
    reshard quoted, `'out $HOME'`, is plain)."""
    if not isinstance(line, str) or len(line) > 16384:
        return False
    body = line.split(" && ", 1)[1] if line.startswith("aws s3 cp ") and line.count(" && ") == 1 else line
    head = line.split(" && ", 1)[0] if body is not line else ""
    if not _inert(body) or not _inert(head):
        return False
    words = body.split(" ")
    while words and _ENV.match(words[0]):
        words.pop(0)
    return words[:2] == ["vllm", "serve"]
