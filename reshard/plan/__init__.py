"""Planning: from config.json and safetensors headers to every rank's files, without reading a byte.

planner   build_plan: walks the architecture's rule table (reshard.rules), stage by stage
context   what the rules see while planning: source lookups, sizes, notes, the scheme
slicers   one rule -> per-rank tensors, a slicer per style; linear and experts in their own modules
quant     the quantization scheme: one strategy object per scheme, chosen from config.json
kvscales  FP8 KV-cache scales: the checkpoint names vLLM 0.32 loads into attention scales
geometry  sizes shared by the slicers and the schemes (Dims, LinearRank, MoeSplit)
files     which file each tensor goes to (natural_key, split_by_size)
model     the plan as data (Plan, OutFile, OutTensor, Slice, Fill, Cols, Stack)

Imports nothing that imports torch or numpy.
"""

from reshard.names import DEFAULT_MAX_PART
from reshard.plan.files import natural_key, split_by_size
from reshard.plan.geometry import Dims
from reshard.plan.model import Cols, Fill, OutFile, OutTensor, Piece, Plan, Slice, Stack, count, flat
from reshard.plan.planner import build_plan, num_experts, pp_ranges
from reshard.plan.quant import Quant
from reshard.plan.slicers import VOCAB_PADDING

__all__ = [
    "DEFAULT_MAX_PART",
    "VOCAB_PADDING",
    "Cols",
    "Dims",
    "Fill",
    "OutFile",
    "OutTensor",
    "Piece",
    "Plan",
    "Quant",
    "Slice",
    "Stack",
    "build_plan",
    "count",
    "flat",
    "natural_key",
    "num_experts",
    "pp_ranges",
    "split_by_size",
]
