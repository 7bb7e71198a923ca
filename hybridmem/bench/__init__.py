"""``hybridmem bench``: a synthetic hybrid engine, switched four ways, measured.

A trainer process trains a transformer (transformers' Llama when importable, else
torch's modules; sized from device memory; variable sequence lengths) and a rollout
process takes a KV cache of a fixed fraction of the device, receives the weights every
cycle and generates; the same run goes through four strategies (``naive``,
``handrolled``, ``tms`` where torch_memory_saver is installed, ``hybridmem``), each in
its own processes.
"""

from hybridmem.bench.figures import Figures, handback_ratio
from hybridmem.bench.plan import MODELS, STRATEGIES, BenchPlan, plan

__all__ = ["MODELS", "STRATEGIES", "BenchPlan", "Figures", "handback_ratio", "plan"]
